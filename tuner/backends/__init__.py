"""How a config's time is measured: on the GPU (a worker process per device,
cuBLAS beside every candidate) or by the analytic model and its calibration."""
