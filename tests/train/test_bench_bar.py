"""The BAR simulation: its clock, its learning rule, determinism and what it reports."""

from click.testing import CliRunner

from orchard.bench.bar import METRICS, Cluster, SimulationParams, World, run
from orchard.cli.bench import bench
from orchard.train.bar import Outcome, Rollout

SMALL = SimulationParams(steps=4, batch=4, candidates=128, held_out_candidates=64, strides=(4, 8))


class Scripted:
    """A world whose rollouts take the given seconds, in order."""

    def __init__(self, durations):
        self.durations = list(durations)

    def rollout(self, prompt):
        return Rollout(1.0, Outcome.COMPLETED, prompt), self.durations.pop(0)


def test_rollouts_share_a_finite_pool_of_sandboxes():
    done = []
    cluster = Cluster(Scripted([10.0, 30.0, 5.0]), slots=2)
    cluster.request(0, 3, lambda rollouts: done.append((cluster.now, len(rollouts))))
    cluster.run()
    assert done == [(30.0, 3)]  # the third starts at 10 s, when a sandbox frees, and ends at 15 s
    assert cluster.sandbox_seconds == 45.0 and cluster.started == 3


def test_aborting_charges_the_running_rollouts_for_the_time_they_ran():
    cluster = Cluster(Scripted([10.0, 100.0, 7.0]), slots=2)
    cluster.request(0, 1, lambda rollouts: cluster.abort_all())
    cluster.request(1, 2, lambda rollouts: None)  # one runs from 0 s, one waits for a sandbox
    cluster.run()
    assert cluster.now == 10.0 and cluster.sandbox_seconds == 20.0 and cluster.started == 2


def test_only_groups_with_both_outcomes_move_the_policy():
    world = World(SMALL, seed=0)
    before, held = list(world.own), world.held_out_pass_rate()
    mixed = [Rollout(1.0), Rollout(-1.0), Rollout(-1.0), Rollout(None, Outcome.TIMED_OUT)]
    samples, zero = world.update([(0, mixed), (1, [Rollout(-1.0)] * 4)])
    assert (samples, zero) == (7, 4)
    assert world.own[0] > before[0] and world.own[1] == before[1] and world.own[2:] == before[2:]
    assert world.shared > 0 and world.held_out_pass_rate() > held  # transfer reaches the held-out prompts


def test_simulation_is_deterministic_and_complete():
    first, second = run(2, SMALL), run(2, SMALL)
    assert first["summary"] == second["summary"]
    assert list(first["summary"]) == SMALL.methods()
    for method, summary in first["summary"].items():
        assert set(summary) == set(METRICS)
        for key in ("held_out_at_equal_sandbox_time", "held_out_at_equal_wall_clock", "held_out_at_equal_steps"):
            assert 0 < summary[key]["mean"] < 1
        assert 0 <= summary["zero_advantage_share"]["mean"] <= 1
        assert summary["rollouts_per_step"]["mean"] <= summary["rollouts_per_step_max"]["mean"]
        assert summary["wall_clock_per_step_s"]["mean"] > SMALL.train_s
    s = first["summary"]
    assert s["fixed_g"]["rollouts_per_step"]["mean"] == SMALL.batch * SMALL.group_size
    assert s["downsample"]["rollouts_per_step"]["mean"] == SMALL.batch * SMALL.max_rollouts
    assert s["dapo"]["zero_advantage_share"]["mean"] == 0.0  # the dynamic filter drops them
    assert s["dapo"]["prompts_per_step"]["mean"] >= SMALL.dapo_over_sampling * SMALL.batch
    assert s["fixed_g"]["fallback_rate"] is None and s["bar_s4"]["adapted_share"] is None
    assert s["bar_adaptive_s4"]["adapted_share"]["mean"] > 0  # its first stride is G, not 4
    assert set(first["winners"]) and first["sandbox_budget_hours"] > 0


def test_the_command_prints_the_table(tmp_path):
    result = CliRunner().invoke(bench, ["bar", "--seeds", "1", "--steps", "2", "--group-size", "4",
                                        "--max-rollouts", "8", "--strides", "4", "--output", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "equal budgets" in result.output and "bar_adaptive_s4" in (tmp_path / "r.json").read_text()
