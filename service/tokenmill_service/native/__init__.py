"""tokenmill's own CPU kernels: C++ sources compiled for this machine on first use (build.py), each
with a thin Python binding (block_gemm.py, vnni_gemm.py, paged_attention.py, elementwise.py) that
the torch backend calls."""
