"""raymoe's own kernels. ``cpu_ops``: fused float32 CPU kernels for the decode path, built from C on first use
(``build``) and optional everywhere (torch operators run when they are off)."""
