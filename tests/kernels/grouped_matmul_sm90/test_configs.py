"""The Hopper kernels' launch configurations on a CPU: what a configuration may ask for, and that every
listed one fits a Hopper SM's shared memory (the offline compile's numbers, ``kernel_resources``, agree
within the barriers' bytes)."""

import pytest

from moe_lowering.kernels.grouped_matmul_sm90 import gluon_launch, jax_launch


@pytest.mark.parametrize("config", [*gluon_launch.CONFIGS.values(), *gluon_launch.TGMM_CONFIGS.values()],
                         ids=lambda c: c.name)
def test_every_listed_config_fits_shared_memory(config):
    assert config.shared_bytes() <= gluon_launch.SHARED_LIMIT


def test_two_staging_buffers_are_counted():
    one = gluon_launch.GluonTgmmConfig(128, 256, 32, stages=4, tail_rows=16)
    two = gluon_launch.GluonTgmmConfig(128, 256, 32, stages=4, tail_rows=16, staging=2)
    assert two.shared_bytes() - one.shared_bytes() == 128 * 256 * 2
    assert two.name != one.name and "-c2" in two.name and "-t16" in one.name


@pytest.mark.parametrize("options, message", [
    (dict(tail_rows=24), "multiple of 16"),
    (dict(tail_rows=128), "dividing block_m"),
    (dict(staging=3), "1 or 2 buffers"),
    (dict(staging=2, pingpong=True, num_warps=4), "1 with ping-pong"),
])
def test_a_config_the_kernel_cannot_run_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        gluon_launch.GluonTgmmConfig(128, 128, 64, **options)


def test_the_default_weight_gradient_config_is_a_listed_one_with_tail_chunks():
    assert jax_launch.DEFAULT_TGMM_CONFIG in gluon_launch.TGMM_CONFIGS.values()
    assert jax_launch.DEFAULT_TGMM_CONFIG.tail_rows == 16
    constexprs = gluon_launch.tgmm_constexprs(jax_launch.DEFAULT_TGMM_CONFIG)
    assert constexprs["TAIL_ROWS"] == 16 and constexprs["STAGING"] == 1
    assert gluon_launch.tgmm_constexprs(gluon_launch.GluonTgmmConfig())["TAIL_ROWS"] == 64
    pingpong = gluon_launch.GluonTgmmConfig(128, 128, 64, stages=4, pingpong=True, num_warps=4)
    assert "STAGING" not in gluon_launch.tgmm_constexprs(pingpong)  # its kernel stages a tile per warp group


def test_a_resident_dout_config_counts_its_resident_rows_and_names_them():
    streamed = gluon_launch.GluonTgmmConfig(128, 256, 64, stages=4, tail_rows=16)
    resident = gluon_launch.GluonTgmmConfig(128, 256, 64, stages=4, tail_rows=16, resident_blocks=3, k_chunk=8)
    # the ring holds lhs boxes only; the resident dout blocks and their two barriers come on top
    assert resident.shared_bytes() == streamed.shared_bytes() - 4 * 64 * 256 * 2 + 3 * 64 * 256 * 2 + 16
    assert "-d3x8" in resident.name and resident.kernel is not streamed.kernel
    assert resident.work_items(256, 7168, 2048) == 256 * 7 * 8  # (group, k chunk of 8 k tiles, n tile)
    assert streamed.work_items(256, 7168, 2048) == 256 * 56 * 8
    constexprs = gluon_launch.tgmm_constexprs(resident)
    assert constexprs["RES_BLOCKS"] == 3 and constexprs["K_CHUNK"] == 8 and "GROUP_M" not in constexprs
    with pytest.raises(ValueError, match="resident dout"):
        gluon_launch.GluonTgmmConfig(128, 256, 64, resident_blocks=3)  # no tail chunks


@pytest.mark.parametrize("rows, groups, expected_rows, resident", [
    (32768, 256, None, True),  # DeepSeek-V3: ~128 rows a group
    (256 * 192, 256, None, True),  # the resident window's rows on average
    (256 * 193, 256, None, False),
    (131072, 128, None, False),  # Qwen3: ~1000
    (4 * 32768, 256, 32768, True),  # an EP=4 receive buffer: its balanced arrival decides
])
def test_small_groups_take_the_resident_dout(rows, groups, expected_rows, resident):
    config = jax_launch.tgmm_config(rows, groups, expected_rows)
    assert config is (jax_launch.RESIDENT_TGMM_CONFIG if resident else jax_launch.DEFAULT_TGMM_CONFIG)
    assert config in gluon_launch.TGMM_CONFIGS.values()


def test_a_resident_dout_leaves_the_longer_groups_to_a_streaming_launch():
    """Every group is written by exactly one launch: the resident kernel's (groups up to its rows) and then
    the streaming kernel's from one row past them; a streaming config is one launch of every group."""
    resident = jax_launch.RESIDENT_TGMM_CONFIG
    assert resident.resident_rows == 192
    (first, first_rows), (second, second_rows) = resident.launches()
    assert first is resident and first_rows is None
    assert second is gluon_launch.LONG_GROUPS_TGMM_CONFIG and not second.resident_blocks
    assert second_rows == resident.resident_rows + 1
    assert jax_launch.DEFAULT_TGMM_CONFIG.launches() == ((jax_launch.DEFAULT_TGMM_CONFIG, 0), )


def test_the_streaming_kernels_take_min_group_rows_and_the_resident_one_does_not():
    """The launch passes ``min_group_rows`` where the kernel has it (``_compile_sm90``'s signature reads the
    kernel's arguments): a scalar the resident kernel lacks would shift every argument after it."""
    for config in gluon_launch.TGMM_CONFIGS.values():
        names = config.kernel.arg_names
        assert ("min_group_rows" in names) == (not config.resident_blocks)
        if "min_group_rows" in names:
            assert names.index("min_group_rows") == names.index("E") + 1
