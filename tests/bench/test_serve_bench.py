"""bench/serve_bench.py on CPU, without processes: the worker flags it passes parse back to the
very settings its engine-alone run uses, its statistics follow the documented definitions, and
the engine-alone path on a transformers-built model streams a + 1 tokens per step under forced
acceptance, reusing the shared prefix as the kvstore would."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import serve_bench as sb  # noqa: E402

from services.common import path_trace  # noqa: E402

QUICK = ["--device", "cpu", "--shape", "tiny-cpu", "--quick"]


def test_worker_flags_parse_back_to_the_engine_alone_settings(tmp_path):
    from services.common.settings import settings_from_args
    from services.gpuworker.main import add_arguments
    from services.gpuworker.settings import WorkerSettings

    args = sb.parse_args([*QUICK, "--no-cuda-graphs", "--no-overlap-steps", "--max-batch-tokens", "128"])
    settings = sb.worker_settings(args, tmp_path, 2)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(WorkerSettings, parser.parse_args(sb.settings_flags(settings))) == settings
    assert settings.forced_acceptance == 2 and settings.cuda_graphs is False and settings.overlap_steps is False and settings.backend == "torch"


def test_level_stats_counts_each_token_of_a_message_once():
    # sent at 0; messages of 1, 4 and 2 tokens at 10, 30 and 40 ms
    trace = sb.Trace(start=0.0, events=[(0.010, 1), (0.030, 4), (0.040, 2)], prompt_tokens=8, cached_tokens=4)
    s = sb.level_stats([trace, sb.Trace(start=0.0, error="UNAVAILABLE: gone")], wall_s=0.05)
    assert s["tokens"] == 7 and s["failed"] == 1 and s["tokens_per_s"] == pytest.approx(140.0)
    assert s["ttft_p50_ms"] == pytest.approx(10.0)
    # four tokens at 20/4 = 5 ms, two at 10/2 = 5 ms
    assert s["itl_p50_ms"] == pytest.approx(5.0) and s["itl_p99_ms"] == pytest.approx(5.0)
    assert s["tokens_per_msg"] == pytest.approx(3.0) and s["hit_rate"] == pytest.approx(0.5)


def test_the_timeline_is_each_requests_send_first_token_and_end_from_the_first_send():
    later = sb.Trace(start=1.5, events=[(1.52, 1)], end=1.6)
    first = sb.Trace(start=1.0, events=[(1.01, 1), (1.03, 2)], end=1.04)
    assert sb.timeline([later, first]) == [[0.0, 10.0, 40.0], [500.0, 520.0, 600.0]]
    assert sb.timeline([]) == []
    # failed requests stay out of it (they have no first token)
    s = sb.level_stats([first, sb.Trace(start=0.0, error="UNAVAILABLE: gone")], wall_s=0.05)
    assert s["timeline_ms"] == [[0.0, 10.0, 40.0]]


def test_decode_gaps_are_the_stretches_between_waves_with_nothing_decoding():
    # two requests decode 10-40 and 20-60; the next wave's first tokens come at 75 and 70; a
    # last one starts decoding at 90, inside the second wave (no gap)
    timeline = [[0, 10, 40], [0, 20, 60], [41, 75, 120], [61, 70, 100], [101, 90, 130]]
    assert sb.decode_gaps(timeline) == {"decode_gaps": 1, "decode_gap_ms_total": 10.0, "decode_gap_ms_max": 10.0}
    # a third wave of two that do not overlap: 130 -> 140 and 145 -> 150
    assert sb.decode_gaps(timeline + [[121, 150, 160], [131, 140, 145]]) == {
        "decode_gaps": 3, "decode_gap_ms_total": 25.0, "decode_gap_ms_max": 10.0}
    assert sb.decode_gaps([]) == {"decode_gaps": 0, "decode_gap_ms_total": 0.0, "decode_gap_ms_max": 0.0}
    assert sb.gaps_line(sb.decode_gaps(timeline)) == "; nothing decoding 10 ms in 1 gaps (longest 10)"
    assert sb.gaps_line(sb.decode_gaps(timeline), "served") == "; served nothing decoding 10 ms in 1 gaps (longest 10)"


def test_step_stats_are_the_counters_moved_over_the_level():
    before = {"steps": 10.0, "step_s": 0.5, "tokens": 100.0}
    after = {"steps": 30.0, "step_s": 0.9, "tokens": 180.0}
    s = sb.step_stats(before, after, wall_s=0.5)
    assert s["steps"] == 20 and s["step_ms_mean"] == pytest.approx(20.0)
    assert s["tokens_per_step"] == pytest.approx(4.0) and s["in_step_share"] == pytest.approx(0.8)
    assert sb.step_stats({}, after, wall_s=0.5) == {}  # no metrics endpoint: nothing claimed


def test_engine_alone_forced_acceptance_on_a_transformers_model(tmp_path):
    args = sb.parse_args([*QUICK, "--accept", "3", "--alone-busy-procs", "1"])
    facts = sb.build_model("tiny-cpu", tmp_path, "cpu", seed=0)
    assert (tmp_path / "config.json").is_file() and facts["params"] > 0
    prompts = sb.Prompts(0, args.prompt_len, sb.SHAPES["tiny-cpu"].vocab_size)
    level = sb.Level(concurrency=2, k=3, a=3, requests=3, max_new_tokens=16)
    served = [{"a": 3, "levels": [{**asdict(level), "tokens_per_s": 1.0}]}]
    (row,) = sb.run_engine_alone(args, tmp_path, prompts, served, log=lambda _msg: None)
    assert row["failed"] == 0 and row["tokens"] == 3 * 16
    assert row["tokens_per_msg"] == pytest.approx(15 / 4)  # 1 after prefill, then 4, 4, 4, 3
    assert row["hit_rate"] == pytest.approx(16 / 64)  # 32 shared tokens, span 1: one whole block
    # the step counters cover every streamed token, and the steps took part of the level's wall
    assert row["steps"] > 0 and row["tokens_per_step"] * row["steps"] == pytest.approx(row["tokens"])
    assert 0 < row["in_step_share"] <= 1
    # three prompts were prefilled, by at least one step each unless two shared one; the rest decoded
    assert 1 <= row["prefill_steps"] < row["steps"]
    # and again beside a busy process: the same requests and tokens, its own timings
    assert row["busy"]["tokens"] == row["tokens"] and row["busy"]["steps"] > 0 and row["busy"]["failed"] == 0
    assert row["prefill_step_ms_mean"] > 0 and row["decode_step_ms_mean"] > 0


def test_router_procs_spread_the_clients_over_connections_and_k0_runs_only_plain_levels():
    CPU = ["--device", "cpu", "--shape", "tiny-cpu"]  # not --quick: it sets its own levels
    one = sb.parse_args([*CPU, "--concurrency", "64"])
    assert sb.client_channels(one) == 1  # the single-connection baseline of earlier runs
    two = sb.parse_args([*CPU, "--concurrency", "16,64", "--router-procs", "2"])
    assert sb.client_channels(two) == 64  # one connection per client of the largest level
    assert sb.client_channels(sb.parse_args([*CPU, "--router-procs", "2", "--client-channels", "8"])) == 8
    # every router process counts: the parent, its serving children (router.1 ...), not the others
    assert sb.router_cpu({"router": 0.1, "router.1": 2.0, "router.2": 3.0, "worker0": 9.0, "client": 1.0}) == pytest.approx(5.1)
    plain = sb.parse_args([*CPU, "--k", "0", "--concurrency", "64"])
    assert plain.accept == [0] and [lv.name for lv in sb.levels_of(plain, 0)] == ["c64 k0"]
    with pytest.raises(SystemExit):
        sb.parse_args([*CPU, "--router-procs", "0"])


def test_between_step_shares_split_the_wall_outside_steps():
    before = {"steps": 10.0, "step_s": 0.5, "tokens": 100.0, "between_s": 1.0}
    after = {"steps": 30.0, "step_s": 0.9, "tokens": 180.0, "between_s": 1.05}
    s = sb.step_stats(before, after, wall_s=0.5)
    assert s["in_step_share"] == pytest.approx(0.8) and s["between_share"] == pytest.approx(0.1)
    assert s["waiting_share"] == pytest.approx(0.1)
    older = {k: v for k, v in after.items() if k != "between_s"}  # a worker without the counter
    assert "between_share" not in sb.step_stats(before, older, wall_s=0.5)
    assert "idle_share" not in s  # a worker without the idle counter
    s = sb.step_stats({**before, "idle_s": 2.0}, {**after, "idle_s": 2.03}, wall_s=0.5)
    assert s["idle_share"] == pytest.approx(0.06) and s["waiting_share"] == pytest.approx(0.1)


def test_prefill_steps_are_split_from_the_decode_steps():
    before = {"steps": 10.0, "step_s": 0.5, "tokens": 100.0, "prefill_steps": 2.0, "prefill_step_s": 0.2}
    after = {"steps": 30.0, "step_s": 0.9, "tokens": 180.0, "prefill_steps": 6.0, "prefill_step_s": 0.28}
    s = sb.step_stats(before, after, wall_s=0.5)
    # 4 steps with prompts took 80 ms (20 each); the other 16 took 320 ms (20 each)
    assert s["prefill_steps"] == 4 and s["prefill_step_ms_mean"] == pytest.approx(20.0)
    assert s["decode_step_ms_mean"] == pytest.approx(20.0)
    after["prefill_step_s"] = 0.44  # 240 ms with prompts: 60 each, the decodes 160 / 16 = 10
    s = sb.step_stats(before, after, wall_s=0.5)
    assert s["prefill_step_ms_mean"] == pytest.approx(60.0) and s["decode_step_ms_mean"] == pytest.approx(10.0)
    assert "with prompts, 60.0 ms each; decode 10.00 ms" in sb.steps_line(s)
    older = {k: v for k, v in after.items() if not k.startswith("prefill")}  # a worker without the metric
    assert "prefill_steps" not in sb.step_stats(before, older, wall_s=0.5)


def test_each_decode_steps_wait_for_the_device_is_the_counter_moved_over_its_decode_steps():
    before = {"steps": 10.0, "step_s": 0.5, "tokens": 100.0, "prefill_steps": 2.0, "prefill_step_s": 0.2,
              "decode_wait_s": 0.1, "prefill_wait_s": 0.05}
    after = {"steps": 30.0, "step_s": 0.9, "tokens": 180.0, "prefill_steps": 6.0, "prefill_step_s": 0.28,
             "decode_wait_s": 0.18, "prefill_wait_s": 0.5}
    s = sb.step_stats(before, after, wall_s=0.5)
    # 16 decode steps waited 80 ms together: 5 ms each of their 20 (the prompts' waits apart)
    assert s["decode_wait_ms_mean"] == pytest.approx(5.0)
    assert "decode 20.00 ms, 5.00 of it waiting for the device" in sb.steps_line(s)
    older = {k: v for k, v in after.items() if not k.endswith("wait_s")}  # a worker without the metric
    assert "decode_wait_ms_mean" not in sb.step_stats(before, older, wall_s=0.5)


def test_the_wall_split_adds_up_and_compare_steps_plots_it(tmp_path, capsys):
    stats = {"tokens": 1000, "tokens_per_s": 500.0, "steps": 110, "prefill_steps": 10, "prefill_step_ms_mean": 20.0,
             "decode_step_ms_mean": 12.0, "in_step_share": 0.7, "between_share": 0.2}
    split = sb.wall_split(stats)  # 2 s: 1.2 decoding, 0.2 with prompts, 0.4 between, the rest waiting
    assert split["decode steps"] == pytest.approx(1.2) and split["steps with prompts"] == pytest.approx(0.2)
    assert split["between steps"] == pytest.approx(0.4) and split["waiting"] == pytest.approx(0.2)
    alone = {**stats, "tokens_per_s": 1000.0, "decode_step_ms_mean": 6.0, "in_step_share": 0.96}
    del alone["between_share"]  # the engine alone's loop: its time outside steps counts as between
    assert sb.wall_split(alone)["between steps"] == pytest.approx(0.04) and sb.wall_split(alone)["waiting"] == pytest.approx(0.16)
    level = {"concurrency": 64, "k": 0, "a": None, "requests": 8, "failed": 0}
    res = {"served": [{"levels": [{**level, **stats}]}], "engine_alone": [{**level, **alone}]}
    files = []
    for name in ("first", "second"):
        files.append(tmp_path / f"s36_{name}.json")
        files[-1].write_text(json.dumps(res))
    png = tmp_path / "steps.png"
    assert sb.main(["--compare-steps", *map(str, files), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
    out = capsys.readouterr().out
    assert out.startswith("first c64 k0: served decode steps 1.20") and "\nsecond c64 k0" in out  # "s36_" dropped


@pytest.mark.parametrize("concurrency,requests,n", [(64, 192, 4), (1, 4, 4), (6, 18, 4), (16, 16, 3)])
def test_client_processes_share_the_slots_and_send_each_request_once(concurrency, requests, n):
    level = sb.Level(concurrency=concurrency, k=0, a=None, requests=requests, max_new_tokens=8)
    shares = sb.client_shares(level, n)
    assert len(shares) == n and sum(c for c, _ in shares) == concurrency
    sent = sorted(i for _, indices in shares for i in indices)
    assert sent == list(range(requests))
    for clients, indices in shares:
        assert bool(clients) == bool(indices)  # no process holds requests it has no client for
        # each process's requests are its slots' share: as many rounds as the level has
        assert len(indices) == clients * (requests // concurrency) or requests % concurrency


def test_ttft_split_is_the_mean_of_the_level_as_router_and_worker_timed_it():
    before = {"router_ttft_s": 1.0, "router_ttft_n": 10.0, "worker_ttft_s": 0.5, "worker_ttft_n": 10.0,
              "queue_ttft_s": 0.1, "queue_ttft_n": 10.0}
    after = {"router_ttft_s": 1.6, "router_ttft_n": 16.0, "worker_ttft_s": 0.62, "worker_ttft_n": 16.0,
             "queue_ttft_s": 0.13, "queue_ttft_n": 16.0}
    s = sb.ttft_split(before, after)
    assert s["ttft_mean_router_ms"] == pytest.approx(100.0) and s["ttft_mean_worker_ms"] == pytest.approx(20.0)
    assert s["ttft_mean_queue_ms"] == pytest.approx(5.0)
    assert sb.ttft_split(before, before) == {}  # no request completed: no mean claimed


@pytest.mark.parametrize("interleave", [True, False])
def test_each_alone_level_runs_right_after_its_served_twin_unless_told_otherwise(tmp_path, interleave):
    """The whole CPU smoke run (kvstore, worker and router processes): with ``--interleave``
    (the default) each level's engine-alone twin runs between it and the next served level, so
    the two sides of a ratio run seconds apart; without it, after every served level. Either way
    every served level has its twin, with the request count the served level finished."""
    out = tmp_path / "run.json"
    flags = [*QUICK, "--json", str(out)] + ([] if interleave else ["--no-interleave"]) + ["--path-trace"]
    assert sb.main(flags) == 0
    res = json.loads(out.read_text())
    served = [row for suite in res["served"] for row in suite["levels"]]
    alone = res["engine_alone"]
    key = ("concurrency", "k", "a", "requests")
    assert [tuple(r[k] for k in key) for r in alone] == [tuple(r[k] for k in key) for r in served]
    assert len(served) == 6 and all(r["failed"] == 0 and r["tokens"] > 0 for r in served + alone)
    ends = [r["ended_at"] for r in served], [r["ended_at"] for r in alone]
    if interleave:
        assert all(s < a for s, a in zip(*ends)) and all(a < s for a, s in zip(ends[1], ends[0][1:]))
    else:
        assert max(ends[0]) < min(ends[1])
    assert all(row["served_over_alone"] > 0 for row in sb.combine(res))
    # --path-trace: every served level saw each hop of the way to the first token, router to engine and back
    for row in served:
        assert list(row["path_ms"]) == [f"{a} → {b}" for a, b in zip(path_trace.POINTS, path_trace.POINTS[1:])]
        assert all(ms >= 0 for ms in row["path_ms"].values())


def test_a_level_run_several_times_reports_its_median_pair():
    """``--repeats``: the i-th served run of a level pairs with its i-th alone run; the row shown
    is the median pair's (the lower of an even count), every pair's ratio kept beside it."""
    def row(c, tps):
        return {"concurrency": c, "k": 0, "a": None, "tokens_per_s": tps}

    res = {"served": [{"levels": [row(1, 90), row(64, 800), row(1, 80), row(64, 900), row(1, 99), row(64, 700)]}],
           "engine_alone": [row(1, 100), row(64, 1000), row(1, 100), row(64, 1000), row(1, 100), row(64, 1000)]}
    by_c = {r["served"]["concurrency"]: r for r in sb.combine(res)}
    assert by_c[1]["ratios"] == pytest.approx([0.9, 0.8, 0.99]) and by_c[1]["served_over_alone"] == pytest.approx(0.9)
    assert by_c[64]["served"]["tokens_per_s"] == 800 and sb.ratio_cell(by_c[64]) == "0.80 (0.80, 0.90, 0.70)"
    res = {"served": [{"levels": [row(1, 90), row(1, 80)]}], "engine_alone": [row(1, 100), row(1, 100)]}
    assert sb.combine(res)[0]["served_over_alone"] == pytest.approx(0.8)
    args = sb.parse_args([*QUICK, "--repeats", "2"])
    levels = sb.levels_of(args, args.accept[0])
    first, second = levels[: len(levels) // 2], levels[len(levels) // 2:]
    assert [sb.dataclasses.replace(lv, repeat=1) for lv in first] == second and {lv.repeat for lv in first} == {0}
    # a level run again sends other prompts under other request ids: none of them is cached from its first run
    assert prompts_differ(first[0], second[0]) and first[0].request_id("a0", 0) != second[0].request_id("a0", 0)


def prompts_differ(a, b) -> bool:
    prompts = sb.Prompts(0, 64, 1000)
    return prompts.get(a, 0)[32:] != prompts.get(b, 0)[32:] and prompts.get(a, 0)[:32] == prompts.get(b, 0)[:32]
