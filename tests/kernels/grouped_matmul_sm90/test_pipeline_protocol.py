"""The Gluon grouped GEMM's barrier protocol (``gluon_kernels``: the ring's ``ready``/``empty`` mbarriers, and
the ping-pong warp groups' ``turn`` barriers) played out on a CPU under random interleavings.

A model, not the kernel: each partition is a generator that yields the mbarrier it waits on and the parity
(the kernel's waits, arrives and stage indices, step for step), and a scheduler runs a random unblocked one.
mbarriers behave as ``mbarrier.try_wait.parity`` does: a wait for parity ``p`` passes once the barrier's
current phase has a parity other than ``p``, so a waiter a whole phase ahead passes falsely. Checked: every
MMA reads the stage holding its own K step (never a stale or a refilled one), the producer never refills a
stage an MMA still reads, and nothing deadlocks. The ping-pong warp groups without their turns are caught.
"""

import random

import pytest

STAGES = 3


class Barrier:
    def __init__(self):
        self.completed = 0  # phases completed; count 1: every arrive completes one

    def passes(self, parity: int) -> bool:
        return (self.completed & 1) != parity

    def arrive(self):
        self.completed += 1


class Ring:
    def __init__(self, stages: int):
        self.ready = [Barrier() for _ in range(stages)]
        self.empty = [Barrier() for _ in range(stages)]
        self.holds = [None] * stages  # the K step (ring use) a stage's data belongs to
        self.reading = [None] * stages  # the use an MMA in flight reads from the stage
        self.landing = []  # TMA loads issued, not landed: (stage, use)


def fill(ring: Ring, slot: int, use: int, phase_use: int):
    """The producer's step: wait for ``slot``'s ``phase_use``-th release, then its TMA load of ``use``."""
    yield ring.empty[slot], (phase_use & 1) ^ 1
    assert ring.reading[slot] is None, f"use {use} refills slot {slot} while use {ring.reading[slot]} reads it"
    ring.holds[slot] = None
    ring.landing.append((slot, use))


def producer(ring: Ring, uses: int, stages: int):
    for use in range(uses):
        yield from fill(ring, use % stages, use, use // stages)


def mainloop(ring: Ring, first_use: int, k_steps: int, stages: int):
    """``_mainloop``: wait ready, issue the MMA (it reads the stage until retired), retire the previous one
    (``warpgroup_mma_wait(1)``) and hand its stage back; at the end retire the last and hand it back
    (``_tgmm_mainloop``'s empty group: no steps, nothing handed back)."""
    in_flight = None
    for use in range(first_use, first_use + k_steps):
        stage = use % stages
        yield ring.ready[stage], (use // stages) & 1
        assert ring.holds[stage] == use, f"use {use} reads stage {stage} holding use {ring.holds[stage]}"
        ring.reading[stage] = use
        if in_flight is not None:
            ring.reading[in_flight % stages] = None
            ring.empty[in_flight % stages].arrive()
        in_flight = use
    if in_flight is not None:
        ring.reading[in_flight % stages] = None
        ring.empty[in_flight % stages].arrive()


def cooperative_consumer(ring: Ring, tiles: int, k_steps: int, stages: int):
    for tile in range(tiles):
        yield from mainloop(ring, tile * k_steps, k_steps, stages)


def pingpong_consumer(ring: Ring, turn, tiles: int, k_steps: int, stages: int, wg: int):
    for program_tile in range(wg, tiles, 2):
        if turn is not None:
            yield turn[wg], ((program_tile // 2) & 1) ^ (1 - wg)
        yield from mainloop(ring, program_tile * k_steps, k_steps, stages)
        if turn is not None:
            turn[1 - wg].arrive()


def play(partitions, ring: Ring, rng: random.Random):
    """Runs the partitions and the TMA engine in a random order until all are done; raises on deadlock."""
    waiting = {i: None for i in range(len(partitions))}
    live = set(waiting)
    while live or ring.landing:
        runnable = [i for i in live if waiting[i] is None or waiting[i][0].passes(waiting[i][1])]
        if ring.landing and (not runnable or rng.random() < 0.3):
            stage, use = ring.landing.pop(rng.randrange(len(ring.landing)) if rng.random() < 0.1 else 0)
            ring.holds[stage] = use
            ring.ready[stage].arrive()
            continue
        if not runnable:
            raise AssertionError(f"deadlock: every partition waits ({waiting})")
        i = rng.choice(runnable)
        try:
            waiting[i] = next(partitions[i])
        except StopIteration:
            live.discard(i)


@pytest.mark.parametrize("tiles, k_steps", [(1, 1), (5, 1), (4, 2), (7, 3), (6, 7)])
def test_cooperative_ring(tiles, k_steps):
    for seed in range(40):
        ring = Ring(STAGES)
        play([producer(ring, tiles * k_steps, STAGES), cooperative_consumer(ring, tiles, k_steps, STAGES)], ring,
             random.Random(seed))


@pytest.mark.parametrize("tiles, k_steps", [(1, 2), (2, 1), (5, 1), (4, 4), (7, 3), (6, 7)])
def test_pingpong_warp_groups_take_turns(tiles, k_steps):
    for seed in range(40):
        ring, turn = Ring(STAGES), [Barrier(), Barrier()]
        play([producer(ring, tiles * k_steps, STAGES),
              *(pingpong_consumer(ring, turn, tiles, k_steps, STAGES, wg) for wg in (0, 1))], ring, random.Random(seed))


def test_pingpong_without_turns_is_caught():
    """The second warp group waits on a ring phase its first use is not in yet, and passes falsely."""
    failures = 0
    for seed in range(40):
        ring = Ring(STAGES)
        try:
            play([producer(ring, 4 * 4, STAGES),
                  *(pingpong_consumer(ring, None, 4, 4, STAGES, wg) for wg in (0, 1))], ring, random.Random(seed))
        except AssertionError:
            failures += 1
    assert failures


def tgmm_consumer(ring: Ring, steps_per_tile, stages: int):
    """``_tgmm_mainloop`` over tiles of the given row-block counts (0: an empty group)."""
    use = 0
    for steps in steps_per_tile:
        yield from mainloop(ring, use, steps, stages)
        use += steps


@pytest.mark.parametrize("steps_per_tile", [[0], [0, 0, 3], [1, 0, 2, 0, 0, 5], [4, 0, 1, 1, 0, 7, 2]])
def test_tgmm_ring_with_empty_groups(steps_per_tile):
    for seed in range(40):
        ring = Ring(STAGES)
        play([producer(ring, sum(steps_per_tile), STAGES), tgmm_consumer(ring, steps_per_tile, STAGES)], ring,
             random.Random(seed))


def tgmm_pingpong_consumer(ring: Ring, turn, steps_per_tile, stages: int, wg: int, count_others: bool = True):
    """``_tgmm_pingpong_consumer``: warp group ``wg`` takes tiles ``wg, wg + 2, ...`` in turns, counting the
    other's tiles' steps (unless not ``count_others``) to find where its own start in the ring."""
    use = 0
    for program_tile, steps in enumerate(steps_per_tile):
        if program_tile % 2 == wg:
            yield turn[wg], ((program_tile // 2) & 1) ^ (1 - wg)
            yield from mainloop(ring, use, steps, stages)
            turn[1 - wg].arrive()
        if count_others or program_tile % 2 == wg:
            use += steps


@pytest.mark.parametrize("steps_per_tile", [[0], [0, 3], [2, 0, 0, 5, 1], [1, 1, 0, 7, 2, 0, 3, 4], [6, 0, 0, 0, 2]])
def test_tgmm_pingpong_with_empty_groups(steps_per_tile):
    for seed in range(40):
        ring, turn = Ring(STAGES), [Barrier(), Barrier()]
        play([producer(ring, sum(steps_per_tile), STAGES),
              *(tgmm_pingpong_consumer(ring, turn, steps_per_tile, STAGES, wg) for wg in (0, 1))], ring,
             random.Random(seed))


def test_tgmm_pingpong_counting_only_its_own_steps_is_caught():
    steps_per_tile = [2, 0, 0, 5, 1]
    for seed in range(10):
        ring, turn = Ring(STAGES), [Barrier(), Barrier()]
        with pytest.raises(AssertionError):
            play([producer(ring, sum(steps_per_tile), STAGES),
                  *(tgmm_pingpong_consumer(ring, turn, steps_per_tile, STAGES, wg, count_others=False)
                    for wg in (0, 1))], ring, random.Random(seed))


# The resident ``dout`` of ``tgmm_sm90_resident_kernel``: one more buffer, guarded by ``res_ready`` /
# ``res_empty``, modelled as an extra ring slot (index STAGES) that only the group rows' loads fill. Each tile
# is ``(row blocks, loaded, released)`` as ``schedule.resident_weight_tiles`` gives them.
RES = STAGES


def resident_producer(ring: Ring, tiles, stages: int):
    use = loads = 0
    for blocks, loaded, _ in tiles:
        if loaded:
            yield from fill(ring, RES, loads, loads)
            loads += 1
        for _ in range(blocks):
            yield from fill(ring, use % stages, use, use // stages)
            use += 1


def resident_consumer(ring: Ring, tiles, stages: int, release_every_tile: bool = False):
    """``_resident_consumer``: loaded rows waited for, every block's MMA reading them and its ring stage, the
    rows handed back once the item's MMAs retired (``release_every_tile``: the mutant that hands them back
    after every tile with rows though the producer loads them once an item)."""
    use = loads = 0
    current = None
    for blocks, loaded, released in tiles:
        if loaded:
            yield ring.ready[RES], (loads & 1)
            assert ring.holds[RES] == loads, f"rows load {loads} reads resident rows of {ring.holds[RES]}"
            current = loads
            loads += 1
        if blocks:
            assert ring.holds[RES] == current, f"a tile reads resident rows refilled by load {ring.holds[RES]}"
            ring.reading[RES] = current
        yield from mainloop(ring, use, blocks, stages)
        assert not blocks or ring.holds[RES] == current, "the resident rows were refilled under the tile's MMAs"
        use += blocks
        if released or (release_every_tile and blocks):
            ring.reading[RES] = None
            ring.empty[RES].arrive()


def _resident_tiles(sizes, k_tiles: int, k_chunk: int, block_m: int = 64, resident_blocks: int = 3):
    from moe_lowering.kernels.grouped_matmul_sm90 import schedule

    tiles = schedule.resident_weight_tiles(sizes, sum(sizes), k_tiles * 16, 16, block_m, 16, 16, resident_blocks,
                                           k_chunk, 0, 1)
    return [(schedule.cdiv(t.row_end - t.row0, block_m), t.loaded, t.released) for t in tiles]


@pytest.mark.parametrize("sizes, k_tiles, k_chunk", [
    ([130], 3, 8), ([0, 64, 0], 2, 1), ([10, 500, 0, 192, 193], 5, 2), ([129, 127, 150], 8, 3), ([400], 2, 2)])
def test_resident_window_loads_and_releases(sizes, k_tiles, k_chunk):
    tiles = _resident_tiles(sizes, k_tiles, k_chunk)
    for seed in range(40):
        ring = Ring(STAGES + 1)
        play([resident_producer(ring, tiles, STAGES), resident_consumer(ring, tiles, STAGES)], ring,
             random.Random(seed))


def test_releasing_the_resident_rows_after_every_tile_is_caught():
    """Released after a tile whose item has more k tiles, the rows are refilled under the next tile's MMAs."""
    tiles = _resident_tiles([130, 70], 4, 4)
    failures = 0
    for seed in range(40):
        ring = Ring(STAGES + 1)
        try:
            play([resident_producer(ring, tiles, STAGES), resident_consumer(ring, tiles, STAGES, True)], ring,
                 random.Random(seed))
        except AssertionError:
            failures += 1
    assert failures
