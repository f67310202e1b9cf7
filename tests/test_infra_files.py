"""The container files against what runs here: no container runtime or cluster is available, so these
tests load infra/compose.yaml, the Docker and Kubernetes deployment files, the Kubernetes job template and
infra/Dockerfile and compare their images, ports, databases, paths and environment with infra/servers.sh
and infra/prefect.yaml, which tests/test_servers.py and tests/test_production_stack.py run for real.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
COMPOSE = yaml.safe_load((INFRA / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
SERVERS_SH = (INFRA / "servers.sh").read_text()
PROCESS = yaml.safe_load((INFRA / "prefect.yaml").read_text())
DOCKER = yaml.safe_load((INFRA / "workpools" / "docker.yaml").read_text())
KUBERNETES = yaml.safe_load((INFRA / "workpools" / "kubernetes.yaml").read_text())
JOB_TEMPLATE = json.loads((INFRA / "workpools" / "kubernetes-job-template.json").read_text())
RUNS_DIR = "/data/comlrl"  # the runs volume in the image, the Docker volume and the Kubernetes claim


def servers_sh_default(name: str) -> str:
    """The default servers.sh gives the setting ``name`` (``NAME="${NAME:-default}"``)."""
    [value] = re.findall(rf'{name}="\$\{{{name}:-([^}}]+)\}}"', SERVERS_SH)
    return value


def servers_sh_url(variable: str) -> urllib.parse.ParseResult:
    """The PostgreSQL URL servers.sh --postgres gives a server (``variable="postgresql...://..."``)."""
    [url] = re.findall(rf'{variable}="(postgresql[^"]+)"', SERVERS_SH)
    return urllib.parse.urlparse(url)


def published_port(service: str) -> tuple[str, int, int]:
    [mapping] = SERVICES[service]["ports"][:1]
    host, outside, inside = mapping.split(":")
    return host, int(outside), int(inside)


@pytest.mark.parametrize("service, setting", [("prefect", "PREFECT_PORT"), ("mlflow", "MLFLOW_PORT")])
def test_compose_publishes_each_server_on_loopback_at_the_port_servers_sh_uses(service, setting):
    host, outside, inside = published_port(service)
    assert host == "127.0.0.1" and outside == inside == int(servers_sh_default(setting))
    assert str(inside) in SERVICES[service]["command"]  # the server listens where the port is published
    assert all(port.startswith("127.0.0.1:") for spec in SERVICES.values() for port in spec.get("ports", []))


@pytest.mark.parametrize("server, variable", [("prefect", "prefect_db"), ("mlflow", "mlflow_db")])
def test_each_server_has_its_own_database_and_role_as_servers_sh_postgres_makes_them(server, variable):
    local = servers_sh_url(variable)
    database = SERVICES[f"{server}-db"]["environment"]
    assert database["POSTGRES_USER"] == database["POSTGRES_DB"] == server
    assert local.username == server and local.path == f"/{server}" and local.hostname == "127.0.0.1"
    if server == "prefect":
        container = urllib.parse.urlparse(SERVICES["prefect"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"])
        assert container.scheme == local.scheme == "postgresql+asyncpg"  # the driver Prefect's server needs
    else:
        [uri] = re.findall(r"--backend-store-uri (\S+)", SERVICES["mlflow"]["command"])
        container = urllib.parse.urlparse(uri)
        # Both PostgreSQL; the image installs psycopg2 (plain postgresql://), servers.sh uses psycopg 3.
        assert container.scheme.split("+")[0] == local.scheme.split("+")[0] == "postgresql"
    assert container.username == server and container.path == f"/{server}" and container.hostname == f"{server}-db"


def test_the_images_are_the_major_versions_the_tests_run():
    prefect_tag = SERVICES["prefect"]["image"].split(":")[1]  # prefecthq/prefect:3-python3.11
    mlflow_tag = SERVICES["mlflow"]["image"].split(":")[1]  # ghcr.io/mlflow/mlflow:v3.4.0
    assert prefect_tag.split("-")[0] == version("prefect").split(".")[0]
    assert mlflow_tag.removeprefix("v").split(".")[0] == version("mlflow").split(".")[0]
    for deployment_file in (PROCESS, DOCKER, KUBERNETES):
        assert deployment_file["prefect-version"] == version("prefect")


def test_every_work_pool_deploys_the_retraining_flow_the_process_pool_runs():
    [process] = PROCESS["deployments"]
    for deployment_file in (DOCKER, KUBERNETES):
        [deployment] = deployment_file["deployments"]
        assert deployment["entrypoint"] == process["entrypoint"]
        assert set(deployment["parameters"]) == set(process["parameters"])
        assert deployment["parameters"]["spec_path"] == process["parameters"]["spec_path"]
        assert deployment["schedules"] == process["schedules"]
        assert deployment["concurrency_limit"] == process["concurrency_limit"]  # one retraining at a time
        assert deployment["parameters"]["workdir"] == RUNS_DIR
        env = deployment["work_pool"]["job_variables"]["env"]
        assert env["PREFECT_LOCAL_STORAGE_PATH"].startswith(RUNS_DIR + "/")  # resumable: on the volume too


@pytest.mark.parametrize("deployment_file", [PROCESS, DOCKER, KUBERNETES], ids=["process", "docker", "kubernetes"])
def test_each_deployment_file_is_what_prefect_deploy_reads(deployment_file):
    from prefect.cli.deploy._models import PrefectYamlModel  # the model `prefect deploy` validates a file with

    [deployment] = PrefectYamlModel.model_validate(deployment_file).deployments
    assert deployment.concurrency_limit.collision_strategy == "CANCEL_NEW"


def test_the_image_holds_the_project_where_the_container_deployments_pull_it():
    dockerfile = (INFRA / "Dockerfile").read_text()
    [workdir] = re.findall(r"^WORKDIR (\S+)", dockerfile, re.MULTILINE)
    assert f"COMLRL_PROJECT_DIR={workdir}" in dockerfile and f"mkdir -p {RUNS_DIR}" in dockerfile
    for deployment_file in (DOCKER, KUBERNETES):
        [step] = deployment_file["pull"]
        assert step["prefect.deployments.steps.set_working_directory"]["directory"] == workdir
    assert re.search(r'pip install "\.\[pipeline\]"', dockerfile)


def test_the_docker_pool_reaches_the_compose_servers_by_service_name():
    [deployment] = DOCKER["deployments"]
    variables = deployment["work_pool"]["job_variables"]
    assert variables["networks"] == [f"{COMPOSE['name']}_default"]
    _, _, prefect_port = published_port("prefect")
    _, _, mlflow_port = published_port("mlflow")
    assert variables["env"]["PREFECT_API_URL"] == f"http://prefect:{prefect_port}/api"
    assert variables["env"]["MLFLOW_TRACKING_URI"] == f"http://mlflow:{mlflow_port}"
    assert variables["volumes"] == [f"comlrl-runs:{RUNS_DIR}"]


def test_the_kubernetes_job_template_takes_every_job_variable_and_mounts_the_runs_claim():
    [deployment] = KUBERNETES["deployments"]
    variables = deployment["work_pool"]["job_variables"]
    assert set(variables) <= set(JOB_TEMPLATE["variables"]["properties"]), set(variables) - set(
        JOB_TEMPLATE["variables"]["properties"])
    pod = JOB_TEMPLATE["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "{{ image }}" and container["env"] == "{{ env }}"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    [mount] = container["volumeMounts"]
    [volume] = pod["volumes"]
    assert mount == {"name": volume["name"], "mountPath": RUNS_DIR}
    assert volume["persistentVolumeClaim"]["claimName"] == "{{ runs_claim }}"
    claim = yaml.safe_load((INFRA / "workpools" / "kubernetes-pvc.yaml").read_text())
    assert variables["runs_claim"] == claim["metadata"]["name"] == JOB_TEMPLATE["variables"]["properties"][
        "runs_claim"]["default"]
    assert variables["namespace"] == claim["metadata"]["namespace"]
    assert variables["env"]["MLFLOW_TRACKING_URI"].endswith(f":{published_port('mlflow')[2]}")
