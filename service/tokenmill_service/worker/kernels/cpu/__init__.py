"""tokenmill's own CPU kernels: C++ sources compiled for this machine on first use (build.py), against
one ABI written once (abi.py), each with a thin Python binding (block_gemm.py, vnni_gemm.py,
paged_attention.py, elementwise.py, decoder_stack.py); ops.py is the ``native`` ops backend."""
