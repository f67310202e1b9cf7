"""Where models run: device placement, data parallelism, FSDP sharding, precision and memory."""
