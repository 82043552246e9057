"""The forward grouped product ``out[r] = lhs[r] @ rhs[group(r)]`` as a Hopper-native Gluon kernel.

* :mod:`.schedule`: the persistent tile schedule as plain Python (the kernel mirrors it; tested on a CPU);
* :mod:`.gluon_kernels`: the warp-specialised kernel (a TMA producer warp, ``wgmma`` consumer warp groups);
* :mod:`.gluon_launch`: tile configurations, host-side TMA descriptors, the launch on torch tensors and an
  offline ``sm_90`` compile;
* :mod:`.reference`: the contract, ``grouped_matmul.reference``'s, on NumPy arrays.

Not wired into the JAX backends yet: ``benchmarks/gluon_gmm_probe.py`` checks and times it on a GPU.
Importing this package imports neither Triton nor JAX.
"""
