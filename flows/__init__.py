"""Orchestration of comlrl training runs (Prefect flows, MLflow tracking, the CLI)."""
