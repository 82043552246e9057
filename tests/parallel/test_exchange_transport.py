"""``exchange_transport="auto"``, the default: ``"peer"`` on a one-process GPU mesh with the
Triton kernels, ``"all_to_all"`` elsewhere; every entry point runs and names the resolved one."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from moe_lowering import moe_optimize
from moe_lowering.kernels import BackendUnavailable
from moe_lowering.parallel import exchange, plan_layout, sharded_moe, sharded_sparse_moe
from moe_lowering.parallel.exchange import TRANSPORTS, resolve_transport
from parallel_cases import random_case, swiglu_program

E = 8
CPUS = jax.devices("cpu")[:8]


@dataclass(frozen=True)
class FakeGpu:
    """Stands in for a GPU device: hashable, with the ``platform`` that ``resolve_transport`` reads."""

    id: int
    platform: str = "gpu"


GPUS = tuple(FakeGpu(i) for i in range(4))


@pytest.fixture
def one_process_gpus(monkeypatch):
    """This process drives ``GPUS`` and the Triton kernels load."""
    monkeypatch.setattr(exchange.jax, "local_devices", lambda: list(GPUS))
    monkeypatch.setattr(exchange, "get_backend", lambda name: SimpleNamespace(name="triton"))


def test_auto_on_cpus_is_all_to_all():
    assert resolve_transport("auto", CPUS, "xla") == "all_to_all"
    assert resolve_transport("auto", CPUS, "auto") == "all_to_all"


@pytest.mark.parametrize("name", TRANSPORTS)
def test_named_transports_pass_through(name, one_process_gpus):
    assert resolve_transport(name, CPUS, "xla") == name
    assert resolve_transport(name, GPUS, "auto") == name


def test_auto_on_one_process_gpus_is_peer(one_process_gpus):
    assert resolve_transport("auto", GPUS, "auto") == "peer"
    assert resolve_transport("auto", iter(GPUS[:2]), "triton") == "peer"  # a mesh's ``devices.flat`` is an iterator


def test_auto_needs_every_device_local(one_process_gpus):
    assert resolve_transport("auto", GPUS + (FakeGpu(4),), "auto") == "all_to_all"  # another process's GPU


def test_auto_needs_several_gpus(one_process_gpus, monkeypatch):
    assert resolve_transport("auto", GPUS[:1], "auto") == "all_to_all"
    assert resolve_transport("auto", (), "auto") == "all_to_all"  # an abstract mesh's unknown devices
    mixed = GPUS[:1] + (FakeGpu(9, platform="cpu"),)
    monkeypatch.setattr(exchange.jax, "local_devices", lambda: list(mixed))
    assert resolve_transport("auto", mixed, "auto") == "all_to_all"


def test_auto_needs_the_triton_kernels(one_process_gpus, monkeypatch):
    monkeypatch.setattr(exchange, "get_backend", lambda name: SimpleNamespace(name="xla"))
    assert resolve_transport("auto", GPUS, "xla") == "all_to_all"

    def unavailable(name):
        raise BackendUnavailable("no Triton here")

    monkeypatch.setattr(exchange, "get_backend", unavailable)
    assert resolve_transport("auto", GPUS, "triton") == "all_to_all"


def test_sharded_layer_resolves_auto_at_entry(caplog, monkeypatch):
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,), devices=CPUS)
    layout = plan_layout(mesh, P("expert"), [P("expert")] * 3, E)
    tokens, indices, weights, params = random_case(3, num_tokens=64, d_model=32, d_ff=32, num_experts=E, top_k=2)
    asked = []

    def recorded(*args):
        asked.append(args)
        return resolve_transport(*args)

    monkeypatch.setattr(sharded_moe, "resolve_transport", recorded)
    with caplog.at_level(logging.INFO, logger="moe_lowering"):
        out = jax.jit(lambda t, w, p: sharded_sparse_moe(t, indices, w, p, swiglu_program(), num_experts=E,
                                                         layout=layout, backend="xla"))(tokens, weights, params)
    assert out.shape == tokens.shape and bool(jnp.all(jnp.isfinite(out)))
    assert asked == [("auto", tuple(CPUS), "xla")]
    messages = [r.getMessage() for r in caplog.records if r.name == "moe_lowering.parallel.sharded_moe"]
    assert any("all-to-all of token rows" in m and "exchange by all_to_all" in m for m in messages), messages


def test_unknown_transport_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"exchange_transport 'nvshmem'; expected one of 'auto', 'all_to_all'"):
        moe_optimize(lambda x: x, exchange_transport="nvshmem")
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,), devices=CPUS)
    layout = plan_layout(mesh, P("expert"), [P("expert")] * 3, E)
    tokens, indices, weights, params = random_case(4, num_tokens=64, d_model=32, d_ff=32, num_experts=E, top_k=2)
    with pytest.raises(ValueError, match=r"exchange_transport must be one of \('auto', .*got 'nvshmem'"):
        sharded_sparse_moe(tokens, indices, weights, params, swiglu_program(), num_experts=E, layout=layout,
                           exchange_transport="nvshmem")
