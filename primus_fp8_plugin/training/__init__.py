"""Training with Megatron-core: data, model construction and the loop (entry: ``primus_fp8_plugin.train``)."""
