"""Semantic mutation testing: the pass declines a mutated zoo program, or rewrites it exactly.

``moe_lowering.testing.mutate`` changes one eqn of a zoo model (at tiny sizes) in a way that
keeps the program well-typed but changes what it means: a constant, swapped operands, a sibling
op, a cast round trip, a clamp, a shifted index, a scale, a stop_gradient, a moved slice, a
weight applied twice, a flipped axis. Whatever the mutant computes, the rewritten program must
equal the mutant's own dense evaluation (outputs and gradients w.r.t. every param and x, float32,
relative error <= 1e-5 in norm, NaNs in the same places), or the pass must rewrite nothing.

One test per (zoo model, mutation kind), each checking ``MOE_MUTANTS_PER_KIND`` mutants (3 by
default: about 600 mutants in all); ``MOE_MUTATION_SEED`` picks other ones;
``MOE_MUTATION_MODELS=one_per_mechanism`` (CI) leaves out the models that only wrap another's layer
(see ``WRAPPERS``). A failure names every
failing mutant, the mutation, the regions rewritten and the errors; reproduce one with

    python -m moe_lowering.testing.mutate --id '<mutant id>'
"""

from __future__ import annotations

import os

import jax
import pytest

from moe_lowering import explain, moe_optimize
from moe_lowering.testing import mutate
from moe_lowering.testing.zoo import POSITIVE

pytestmark = pytest.mark.mutation

PER_KIND = int(os.environ.get("MOE_MUTANTS_PER_KIND", "3"))
SEED = int(os.environ.get("MOE_MUTATION_SEED", "0"))
DATA_SEED = 1

WRAPPERS = {"two_layers": "mixtral", "flax_moe": "mixtral"}
"""Zoo models whose MoE layer is another model's, as written, only wrapped: ``two_layers`` is
Mixtral's layer twice in sequence, ``flax_moe`` Mixtral's computation on a Flax module's params.
Their mutants mutate that layer, matched by the same rule through the same mechanism (no eqn of
their own between the routing and the combine), so with ``MOE_MUTATION_MODELS=one_per_mechanism``
(CI: .ci/run) the layer mutants run on the wrapped model only; every mutation kind and every
rewrite kind (one-hot gate, capacity, grouped capacity, per-expert loop, gather, the scan body...)
keeps its models, and ``test_unmutated_program_round_trips`` still runs every model (two_layers'
two regions included). The default (``all``) runs every model."""
MUTATION_MODELS = os.environ.get("MOE_MUTATION_MODELS", "all")
assert MUTATION_MODELS in ("all", "one_per_mechanism"), f"MOE_MUTATION_MODELS={MUTATION_MODELS!r}: all or one_per_mechanism"
MUTATED_MODELS = tuple(m for m in mutate.MODELS if MUTATION_MODELS == "all" or m not in WRAPPERS)


@pytest.mark.parametrize("kind", mutate.KIND_NAMES)
@pytest.mark.parametrize("model", MUTATED_MODELS)
def test_mutants_are_declined_or_rewritten_exactly(model, kind):
    mutants = mutate.sample(model, kind, PER_KIND, SEED)
    if not mutants:
        pytest.skip(f"{model} has no site for {kind}")
    outcomes = [mutate.check_mutant(m, DATA_SEED) for m in mutants]
    bad = [o for o in outcomes if o.status in ("wrong", "crashed")]
    if bad:
        pytest.fail(f"{len(bad)} of {len(outcomes)} mutants of {model} ({kind}) were rewritten wrongly or crashed "
                    "the pass:\n\n" + "\n\n".join(o.message() for o in bad), pytrace=False)
    invalid = [o for o in outcomes if o.status == "invalid"]
    assert not invalid, "mutants that cannot be evaluated (a generator bug):\n" + "\n".join(o.message() for o in invalid)


@pytest.mark.parametrize("model", mutate.MODELS)
def test_unmutated_program_round_trips(model):
    """The interpreter itself changes nothing: the unmutated re-emission is rewritten exactly
    (positives) or declined (negatives), and evaluates to the zoo function's own outputs."""
    identity = mutate.Mutant(model, (), "identity", "")
    outcome = mutate.check_mutant(identity, DATA_SEED)
    assert outcome.status == ("exact" if model in POSITIVE else "declined"), outcome.message()
    params, x = identity.args(DATA_SEED)
    assert mutate.relative_error(identity.context.model.fn(params, x), identity.fn(params, x)) == 0.0


def test_mutants_are_reproducible_and_well_typed():
    """Sampling is deterministic, ids round-trip, and every mutant traces to the original types."""
    first = mutate.generate(PER_KIND, SEED)
    assert [m.id for m in first] == [m.id for m in mutate.generate(PER_KIND, SEED)]
    assert len(first) >= 500 or PER_KIND < 3
    assert len({m.id for m in first}) == len(first)
    for mutant in first:
        assert mutate.mutant_from_id(mutant.id) == mutant
    for mutant in first[:: max(1, len(first) // 60)]:
        params, x = mutant.args(0)
        flat = jax.tree.leaves((params, x))
        original = jax.eval_shape(mutant.context.model.fn, params, x)
        mutated = jax.eval_shape(mutant.fn, params, x)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), original) == jax.tree.map(lambda a: (a.shape, a.dtype), mutated)
        assert len(jax.make_jaxpr(mutant.flat_fn)(*flat).eqns) > 0


def test_routing_sites_are_reachable():
    """Mutations reach the routing logic, inlined jits and scan bodies included: one_hot's
    comparison, cumsum, the capacity mask, top_k, the gate scatter."""
    expected = [("switch", "cumsum"), ("switch", "eq"), ("switch", "lt"), ("switch", "argmax"),
                ("gshard_top2", "cumsum"), ("mixtral", "top_k"), ("mixtral", "eq"), ("deepseek_v3", "scatter"),
                ("scan_layers", "top_k"), ("hf_loop", "eq")]
    for model, primitive in expected:
        sites = [s for s in mutate.model_context(model).sites if str(s.eqn.primitive) == primitive]
        assert sites and all(s.routing for s in sites), (model, primitive)
        kinds = {k for k in mutate.KIND_NAMES for s in sites if mutate.KINDS[k].at(s)}
        assert len(kinds) >= 3, (model, primitive, kinds)
    cumsum = next(s for s in mutate.model_context("switch").sites if str(s.eqn.primitive) == "cumsum")
    assert "cumsum->cumsum_rev" in mutate.KINDS["replace_op"].at(cumsum)
    assert any(m.path[:1] == (0,) and len(m.path) == 2 for m, _ in mutate.candidates("scan_layers", "int_shift"))


def test_mutant_fn_goes_through_moe_optimize():
    """``Mutant.fn(params, x)`` is a plain JAX function: ``moe_optimize`` (jitted) rewrites it like
    ``optimize_jaxpr`` does for the oracle, and agrees with it."""
    mutant = next(m for m in mutate.sample("mixtral", "scale", 10, SEED)
                  if mutate.check_mutant(m, DATA_SEED).status == "exact")
    params, x = mutant.args(DATA_SEED)
    assert len(explain(mutant.fn, params, x).regions) == 1
    rewritten = jax.jit(moe_optimize(mutant.fn, strict=True))(params, x)
    assert mutate.relative_error(mutant.fn(params, x), rewritten) < mutate.TOLERANCE
