"""Elastic DiLoCo / GASLoC / SparseLoCo on torchft: workers killed, frozen, restarted and added
while the job runs, and the lighthouse restarted. Real processes (a lighthouse and one
``python -m scape_train`` per worker, each its own replica group), gloo on the CPU, real signals.

For every fault: the job never stops (the survivors end normally), the committed rounds are the
same on every replica (DiLoCo: the final parameters are equal bit for bit), the tokens are
counted (a survivor commits every batch it read, exactly once; a restarted worker resumes its
shard where it last committed, so only a dead worker's unfinished round is ever read twice, by
itself, and none is skipped), and the final validation loss is within ``LOSS_TOL`` of the
fault-free run of the same number of rounds.
"""

from __future__ import annotations

import signal
import time

import pytest

from scape_train.config import ConfigError, validate
from tests import _fault_job as fj
from tests._elastic_job import H, ElasticJob
from tests.helpers import compose_config

pytest.importorskip("torchft")

ROUNDS = 12              # short rows: 12 rounds of H = 5 steps
# nats. A fault changes the trajectory (fewer workers per round, a late starter healed in, a
# failed round's drift joining the next), and at 60 steps a different legitimate trajectory moves
# the final loss this much: fault-free runs of the short job with trainer.seed 1337, 1..4 ended at
# 6.145, 6.064, 6.051, 5.912, 5.905 (a 0.24 range); a worker killed at the vote, 6.065 and 5.951.
# The short job's train loss has flattened by step 15 (5.8-6.1 from there on; 6.8 over steps
# 1-5, ln 2048 = 7.6 at random), so this check catches a diverged or corrupted model, not a
# small loss of progress: equal parameters and counted tokens are the exact checks.
LOSS_TOL = 0.35
SLOW = ("trainer.micro_batch_size=16",)   # long rows: rounds slow enough for a restart to join


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return fj.tok_cache(tmp_path_factory)


@pytest.fixture
def job_factory(tmp_path, cache):
    jobs = []

    def make(*extra: str, strategy: str = "diloco", env: dict | None = None,
             min_replicas: int = 1) -> ElasticJob:
        """A lighthouse and workers 0, 1, 2 (``env``: a slot's extra environment)."""
        job = ElasticJob(tmp_path / "job", cache, *extra, strategy=strategy,
                         min_replicas=min_replicas)
        jobs.append(job)
        job.launch(3, env)
        return job

    yield make
    for job in jobs:
        job.close()


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory, cache):
    """Three workers, no fault: the reference loss for the short rows."""
    job = ElasticJob(tmp_path_factory.mktemp("fault_free"), cache, f"trainer.max_steps={ROUNDS * H}",
                     min_replicas=3)
    try:
        job.launch(3)
        job.wait_done(range(3))
        return job
    finally:
        job.close()


# -- the checks every row makes -------------------------------------------------------------------

def same_params(job: ElasticJob, slots) -> None:
    ref = job.final_params(slots[0])
    for s in slots[1:]:
        fj.assert_same_params(ref, job.final_params(s))


def check_tokens(job: ElasticJob, slot: int) -> int:
    """Every batch this worker read in its last life was committed exactly once (the batch
    counter only grows, and the last round committed with it); a restart resumed at the batch
    count its previous life last committed. Returns the batches it committed."""
    rows = job.rows(slot)
    lives = list(dict.fromkeys(r["pid"] for r in rows))
    committed_before = 0
    for pid in lives:
        life = [r for r in rows if r["pid"] == pid]
        resumed = [r["resumed_batches"] for r in life if "resumed_batches" in r]
        if committed_before:
            assert resumed == [committed_before], (slot, resumed, committed_before)
        rounds = [r for r in life if "committed" in r]
        counts = [r["batches"] for r in rounds]
        assert counts == sorted(counts) and len(set(counts)) == len(counts), counts
        done = [r["batches"] for r in rounds if r["committed"]]
        committed_before = done[-1] if done else committed_before
    last = [r for r in rows if "committed" in r][-1]
    assert last["committed"] and last["batches"] == committed_before, last
    return committed_before


def one_record(job: ElasticJob, slot: int, first_life: list[dict]) -> None:
    """Worker ``slot``'s metrics are one record over all its lives: the steps never go back, the
    rows its first life logged are kept up to its last committed round, and its counters (tokens,
    total bytes sent) continue in a restarted life rather than starting again at 0."""
    rows = job.metrics(slot)
    steps = [r["step"] for r in rows]   # a validation row shares its step with a train row
    assert steps == sorted(steps), steps
    assert rows[0] == first_life[0], (rows[0], first_life[0])
    for key in ("tokens", "comm/total_sent_bytes"):
        values = [(r["step"], r[key]) for r in rows if key in r]
        assert [v for _, v in values] == sorted(v for _, v in values), (key, values)


def kill_and_restart(job: ElasticJob, slot: int, limit_s: float) -> None:
    """SIGKILL worker ``slot`` and start it again (``resume=auto``); then every worker ends on the
    same parameters, each committed every batch it read (the restarted one resumed at its last
    committed batch), and the restarted worker's metrics are one record over both lives."""
    job.signal(slot, signal.SIGKILL)
    job.workers[slot].wait()
    first_life = job.metrics(slot)
    job.start(slot)
    slots = sorted(job.workers)
    job.wait_done(slots, limit_s=limit_s)
    same_params(job, slots)
    for s in slots:
        check_tokens(job, s)
    one_record(job, slot, first_life)


def close_loss(job: ElasticJob, slot: int, reference: float) -> None:
    loss = job.val_loss(slot)
    assert abs(loss - reference) < LOSS_TOL, (loss, reference)


def rounds_to_rejoin(job: ElasticJob, slot: int, survivor: int) -> int:
    """Rounds the survivor committed between the rejoining worker's first quorum request and
    the first round it committed."""
    rows = job.rows(slot)
    asked = [r["time"] for r in rows if "first_quorum_request" in r][-1]
    first = min(r["time"] for r in rows if r.get("committed") and r["time"] > asked)
    return sum(1 for r in job.rounds(survivor) if r["committed"] and asked < r["time"] < first)


# -- configuration --------------------------------------------------------------------------------

def test_elastic_config_is_checked_early():
    base = ["strategy=diloco", "strategy.elastic.enabled=true", "strategy.elastic.lighthouse=x"]
    with pytest.raises(ConfigError, match=r"replica=5 must be in \[0, slots=4\)"):
        validate(compose_config([*base, "strategy.elastic.slots=4", "strategy.elastic.replica=5"]))
    with pytest.raises(ConfigError, match="one process"):
        validate(compose_config([*base, "strategy.elastic.slots=2", "strategy.elastic.replica=0"]),
                 world_size=2)
    validate(compose_config([*base, "strategy.elastic.slots=2", "strategy.elastic.replica=1"]))
    with pytest.raises(ConfigError, match="backend must be one of"):
        validate(compose_config([*base, "strategy.elastic.slots=2", "strategy.elastic.replica=1",
                                 "strategy.elastic.backend=mpi"]))
    # data parallelism across replica groups: the dense optimizers and replicated SCAPE,
    # and no step skipped alone
    dp = ["strategy.elastic.enabled=true", "strategy.elastic.slots=2", "strategy.elastic.replica=1"]
    with pytest.raises(ConfigError, match="not optimizer=topk_adamw"):
        validate(compose_config([*dp, "optimizer=topk_adamw"]))
    with pytest.raises(ConfigError, match="sharded=true is not offered"):
        validate(compose_config([*dp, "optimizer=scape", "optimizer.sharded=true"]))
    validate(compose_config([*dp, "optimizer=scape"]))
    with pytest.raises(ConfigError, match="nan_policy=skip"):
        validate(compose_config([*dp, "optimizer=adamw", "trainer.nan_policy=skip"]))
    with pytest.raises(ConfigError, match="one process"):
        validate(compose_config([*dp, "optimizer=adams"]), world_size=2)
    validate(compose_config([*dp, "optimizer=adams"]))


# -- short rows -----------------------------------------------------------------------------------

def test_fault_free_workers_hold_the_same_parameters(fault_free):
    same_params(fault_free, [0, 1, 2])
    for s in range(3):
        assert check_tokens(fault_free, s) == ROUNDS * H
        assert not [r for r in fault_free.rounds(s) if not r["committed"]]


def test_worker_killed_at_an_inner_step(job_factory, fault_free):
    job = job_factory(f"trainer.max_steps={ROUNDS * H}")
    job.wait_mid_round(2)
    job.signal(2, signal.SIGKILL)
    job.wait_done([0, 1])
    same_params(job, [0, 1])
    for s in (0, 1):
        check_tokens(job, s)   # every batch read was committed (a failed round: H more)
        assert job.rounds(s)[-1]["quorum"] == [0, 1]
        close_loss(job, s, fault_free.val_loss(0))


# SCAPE across replica groups at 90% sparsity from its first step (no warm-up): the masks, the
# residuals and the owners' all-gather are in play in every round
SCAPE_DP = ("optimizer=scape", "optimizer.density=0.1", "optimizer.density_warmup_steps=0")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [("optimizer=adamw",), SCAPE_DP,
                                       (*SCAPE_DP, "optimizer.payload_dtype=fp8_e4m3")],
                         ids=["adamw", "scape", "scape_fp8"])
def test_data_parallel_step_fails_on_a_frozen_worker_then_a_joiner_heals(job_factory, optimizer):
    """Data parallelism across replica groups, every step a round, under a lighthouse that
    needs 3 workers. Worker 2 stops itself as its first collective of step 11 starts
    (``SCAPE_FAULT_FREEZE_AT_EXCHANGE``): the others' step fails at the timeout and nobody
    applies it; they wait for a third worker. A fourth joins, heals (the model and the optimizer
    state from a live peer; SCAPE: momentum and masks, its residual at zero), and the three end
    on the same parameters, bit for bit. (Steps of this job take ~15 ms, so under
    ``min_replicas=1`` the two would finish before a joiner's imports do: they go on as two as
    the local-step rows show.)"""
    job = job_factory("trainer.max_steps=60", *optimizer, strategy="data_parallel",
                      env={2: {"SCAPE_FAULT_FREEZE_AT_EXCHANGE": "10"}}, min_replicas=3)
    job.wait_until(lambda: any(not r["committed"] for r in job.rounds(0)), "a failed step")
    job.signal(2, signal.SIGKILL)
    job.start(3)
    job.wait_done([0, 1, 3], limit_s=240)
    same_params(job, [0, 1, 3])
    for s in (0, 1):
        failed = [r["round"] for r in job.rounds(s) if not r["committed"]]
        assert failed == [10], failed
        check_tokens(job, s)
    assert job.rounds(3)[0]["healed"], "the joiner did not heal at its first step"
    assert job.rounds(0)[-1]["quorum"] == [0, 1, 3]
    assert job.val_loss(0) < 7.0, job.val_loss(0)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,extra", [
    ("sparseloco", ("strategy.sparse_chunk=1024", "strategy.sparse_topk=64")),
    ("diloco", ("strategy.outer_payload_dtype=fp4_e2m1", "strategy.outer_error_feedback=1"))],
    ids=["sparseloco", "diloco_fp4_error_feedback"])
def test_all_gather_rounds_survive_a_worker_killed_at_an_inner_step(job_factory, strategy, extra):
    """An all-gather across replica groups (SparseLoCo's; DiLoCo's quantized outer gradients,
    which replica groups carry as an all-gather): worker 2 dies inside a round whose quorum
    holds it, so the survivors' all-gather of that round fails and nobody applies it (each
    survivor puts its error feedback back); from then on the two gather between themselves and
    end on the same parameters."""
    job = job_factory(f"trainer.max_steps={ROUNDS * H}", *extra, strategy=strategy)
    job.wait_mid_round(2)
    job.signal(2, signal.SIGKILL)
    job.wait_done([0, 1])
    same_params(job, [0, 1])
    for s in (0, 1):
        check_tokens(job, s)
        assert job.rounds(s)[-1]["quorum"] == [0, 1]
        # learned: the short job's loss starts at ln 2048 = 7.6 (DiLoCo's ends near 6.0)
        assert job.val_loss(s) < 7.0, job.val_loss(s)
    failed = [r for s in (0, 1) for r in job.rounds(s) if not r["committed"]]
    assert failed, "no round failed: worker 2 died outside a round that held it"
    sent = [r["comm/total_sent_bytes"] for r in job.metrics(0) if "comm/total_sent_bytes" in r]
    assert sent and sent[-1] > 0


# -- long rows ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_worker_killed_at_the_outer_round(job_factory, fault_free):
    job = job_factory(f"trainer.max_steps={ROUNDS * H}", env={2: {"SCAPE_FAULT_KILL_AT_VOTE": "4"}})
    job.wait_done([0, 1])
    assert job.workers[2].returncode == -signal.SIGKILL
    same_params(job, [0, 1])
    for s in (0, 1):
        check_tokens(job, s)
        close_loss(job, s, fault_free.val_loss(0))
    # worker 2 died in round 5, after 4 committed rounds, having committed every batch it read
    # before it (H per round it took part in: a worker slow to start heals in at a later round,
    # and one that heals in at round 5 itself dies having committed none)
    assert job.rows(2), "worker 2 never started"
    done = [r for r in job.rounds(2) if r["committed"]]
    assert not done or (done[-1]["round"] == 4 and done[-1]["batches"] == H * len(done)), done


@pytest.mark.slow
def test_worker_frozen_past_the_timeout_then_heals(job_factory):
    job = job_factory(f"trainer.max_steps={60 * H}", *SLOW)
    # frozen mid-round, so that its peers' exchange waits for it until the timeout (frozen
    # between its vote and the next quorum, or before the others first met it, it would only
    # miss a quorum)
    job.wait_mid_round(2)
    job.signal(2, signal.SIGSTOP)
    frozen = len(job.rounds(0))
    job.wait_until(lambda: len([r for r in job.rounds(0) if r["quorum"] == [0, 1]
                                and r["committed"]]) >= 3, "3 rounds without the frozen worker")
    woke = time.time()
    job.signal(2, signal.SIGCONT)
    job.wait_done([0, 1, 2], limit_s=300)
    same_params(job, [0, 1, 2])
    assert any(not r["committed"] for r in job.rounds(0)[frozen - 1:]), "no round failed"
    # whether it also heals at the start depends on which replica torchft picks as the first
    # quorum's source, so only the heal after the wake is checked
    healed = [r for r in job.rounds(2) if r["healed"] and r["time"] > woke]
    assert healed, "the frozen worker did not heal after it woke"
    for s in (0, 1):
        check_tokens(job, s)


@pytest.mark.slow
def test_killed_worker_restarts_resumes_its_shard_and_heals(job_factory):
    job = job_factory(f"trainer.max_steps={60 * H}", *SLOW)
    job.wait_mid_round(2)
    kill_and_restart(job, 2, limit_s=300)
    assert rounds_to_rejoin(job, 2, survivor=0) <= 2
    assert any(not r["committed"] for s in (0, 1) for r in job.rounds(s)), "no round failed"


@pytest.mark.slow
def test_data_parallel_worker_killed_restarts_resumes_its_shard_and_heals(job_factory):
    """Elastic data parallelism, a lighthouse that needs 3 workers: worker 2 is killed as its
    all-reduce of step 21 starts (frozen there, then SIGKILLed), so the others' step fails and
    they wait; restarted with ``resume=auto`` it resumes its data shard at its last committed
    batch, heals from a peer (the model too), and the three end on the same parameters, its
    metrics one record over both lives."""
    job = job_factory("trainer.max_steps=60", "optimizer=adamw", strategy="data_parallel",
                      env={2: {"SCAPE_FAULT_FREEZE_AT_EXCHANGE": "20"}}, min_replicas=3)
    job.wait_until(lambda: any(not r["committed"] for r in job.rounds(0)), "a failed step")
    kill_and_restart(job, 2, limit_s=240)
    resumed = [r["resumed_batches"] for r in job.rows(2) if "resumed_batches" in r]
    assert resumed == [20], resumed
    assert any(r["healed"] for r in job.rounds(2)), "the restarted worker did not heal"


@pytest.mark.slow
def test_scape_data_parallel_quorum_shrinks_then_grows_back(job_factory):
    """SCAPE across replica groups whose quorum changes size: worker 2 is killed as its first
    collective of step 21 starts, the other two fail that step and go on as two (the owners of
    the next mask re-partitioned over 2), and worker 2, restarted with ``resume=auto``, heals
    and joins them (over 3 again). The flat partitioner cuts tensors between owners, so a mask
    built over 3 has other counts per segment over 2 (read from the mask, not the schedule).
    The three end on the same parameters, bit for bit: every worker took the same masks
    whatever the owners were."""
    job = job_factory("trainer.max_steps=240", *SLOW, *SCAPE_DP, "optimizer.partitioner=flat",
                      strategy="data_parallel",
                      env={2: {"SCAPE_FAULT_FREEZE_AT_EXCHANGE": "20"}}, min_replicas=2)
    job.wait_until(lambda: any(not r["committed"] for r in job.rounds(0)), "a failed step")
    kill_and_restart(job, 2, limit_s=300)
    sizes = [len(r["quorum"]) for r in job.rounds(0) if r["committed"]]
    assert 2 in sizes and sizes[-1] == 3, sizes
    assert any(r["healed"] for r in job.rounds(2)), "the restarted worker did not heal"


@pytest.mark.slow
def test_fourth_worker_joins_mid_run(job_factory):
    job = job_factory(f"trainer.max_steps={60 * H}", *SLOW)
    job.wait_rows(0, 3)
    job.start(3)
    job.wait_done([0, 1, 2, 3], limit_s=300)
    same_params(job, [0, 1, 2, 3])
    assert job.rounds(0)[-1]["quorum"] == [0, 1, 2, 3]
    assert rounds_to_rejoin(job, 3, survivor=0) <= 2
    for s in range(4):
        check_tokens(job, s)
    assert job.rounds(3)[0]["batches"] == H    # a new slot starts its shard at the beginning


@pytest.mark.slow
def test_lighthouse_killed_and_restarted(job_factory):
    job = job_factory(f"trainer.max_steps={40 * H}", *SLOW)
    job.wait_rows(0, 3)
    job.lighthouse.kill()
    job.lighthouse.wait()
    time.sleep(2.0)
    job.start_lighthouse()
    job.wait_done([0, 1, 2], limit_s=300)
    same_params(job, [0, 1, 2])
    for s in range(3):
        # a worker the new lighthouse left out of a few rounds read fewer batches, not lost any
        check_tokens(job, s)


@pytest.mark.slow
def test_gasloc_2peer_worker_killed_peers_drawn_among_the_live(job_factory):
    job = job_factory(f"trainer.max_steps={ROUNDS * H}", "strategy.topology=2peer",
                      strategy="gasloc")
    job.wait_mid_round(2)
    job.signal(2, signal.SIGKILL)
    job.wait_done([0, 1])
    for s in (0, 1):
        check_tokens(job, s)
        assert job.rounds(s)[-1]["quorum"] == [0, 1]
