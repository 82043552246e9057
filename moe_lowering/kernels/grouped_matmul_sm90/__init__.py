"""The forward grouped product ``out[r] = lhs[r] @ rhs[group(r)]`` and its weight gradient ``dw[g] =
lhs[rows of g]^T @ dout[rows of g]`` as Hopper-native Gluon kernels.

* :mod:`.schedule`: the persistent tile schedules as plain Python (the kernels mirror them; tested on a CPU);
* :mod:`.gluon_kernels`: the warp-specialised kernel (a TMA producer warp, ``wgmma`` consumer warp groups);
* :mod:`.gluon_tgmm_kernels`: the weight gradient's, reducing over each group's rows (both operands streamed,
  or for small groups a group's ``dout`` columns resident in shared memory);
* :mod:`.gluon_launch`: tile configurations, host-side TMA descriptors, the launch on torch tensors and an
  offline ``sm_90`` compile;
* :mod:`.reference`: the contract, ``grouped_matmul.reference``'s, on NumPy arrays;
* :mod:`.xla_call` and :mod:`.jax_launch`: the kernels as JAX functions (a custom call that encodes the TMA
  descriptors from the run-time addresses). The Triton backend's ``tgmm`` runs the Gluon weight gradient on
  sm_90 GPUs where :func:`.jax_launch.tgmm_applies`; the forward ``gmm`` is not routed to it (from JAX it ran
  0.58-0.96x ``gmm_kernel`` with its output zeroed first and one config for every shape; the per-K config
  and ``zero_outside=False`` that followed are not yet measured).

``benchmarks/gluon_gmm_probe.py`` (torch) and ``benchmarks/gluon_jax.py`` (JAX) check and time them on a GPU.
Importing this package imports neither Triton nor JAX.
"""
