"""The forward grouped product ``out[r] = lhs[r] @ rhs[group(r)]`` and its weight gradient ``dw[g] =
lhs[rows of g]^T @ dout[rows of g]`` as Hopper-native Gluon kernels.

* :mod:`.schedule`: the persistent tile schedules as plain Python (the kernels mirror them; tested on a CPU);
* :mod:`.gluon_kernels`: the warp-specialised kernel (a TMA producer warp, ``wgmma`` consumer warp groups);
* :mod:`.gluon_tgmm_kernels`: the weight gradient's, reducing over each group's rows;
* :mod:`.gluon_launch`: tile configurations, host-side TMA descriptors, the launch on torch tensors and an
  offline ``sm_90`` compile;
* :mod:`.reference`: the contract, ``grouped_matmul.reference``'s, on NumPy arrays.

Not wired into the JAX backends yet: ``benchmarks/gluon_gmm_probe.py`` checks and times it on a GPU.
Importing this package imports neither Triton nor JAX.
"""
