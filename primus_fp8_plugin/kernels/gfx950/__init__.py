"""FlyDSL kernels for AMD MI355X (gfx950)."""
