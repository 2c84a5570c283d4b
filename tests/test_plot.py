"""``entropy-discriminator plot`` / ``suggest-mu --run`` read each framework's metrics log.

The logs are written here in each framework's own format: TRL's ``trainer_state.json`` (``log_history``), verl's
file logger (``{"step": s, "data": {...}}`` per line, ``verl/utils/tracking.py: FileLogger``) and console logger
(``step:s - key:value - ...``, ``verl/utils/logger/aggregate_logger.py``), OpenRLHF's ``train/`` prefix as JSON lines.
A real TRL run's checkpoint is read in tests/adapters/trl/test_examples_cpu.py, the custom loop's JSON lines in
tests/test_examples_and_packaging.py.
"""

from __future__ import annotations

import json
import math

import pytest

from entropy_discriminator.__main__ import main
from entropy_discriminator.plot import summarise_run
from entropy_discriminator.runlog import read_run

STEPS = [
    {"entropy/mean": 1.0 - 0.1 * i, "clip/frac": [0.0, 0.02, 0.04, 0.02][i], "delta_entropy/predicted": -0.01 * i,
     "delta_entropy/realised": -0.02 * i + 0.001 * (i % 2)}
    for i in range(4)
]


def trl_state(prefix: str = "entropy_disc/") -> str:
    history = [{"step": i + 1, "loss": 0.1, "reward": 0.5, **{prefix + k: v for k, v in row.items()}}
               for i, row in enumerate(STEPS)]
    history.append({"step": 4, "train_runtime": 1.0})  # TRL's last entry: no metrics
    return json.dumps({"global_step": 4, "log_history": history})


def verl_file() -> str:
    return "\n".join(json.dumps({"step": i + 1, "data": {"actor/entropy_disc/" + k: v for k, v in row.items()}})
                     for i, row in enumerate(STEPS))


def verl_console() -> str:
    lines = ["(TaskRunner pid=1) some start-up line", "Creating file logger at /x"]
    lines += [" - ".join([f"step:{i + 1}", "actor/pg_loss:0.1", *(f"entropy_disc/{k}:{v!r}" for k, v in row.items())])
              for i, row in enumerate(STEPS)]
    return "\n".join(lines)


def openrlhf_jsonl() -> str:
    return "\n".join(json.dumps({"step": i + 1, **{"train/entropy_disc/" + k: v for k, v in row.items()}})
                     for i, row in enumerate(STEPS))


@pytest.mark.parametrize("name, text", [("trainer_state.json", trl_state()), ("verl.jsonl", verl_file()),
                                        ("verl_console.log", verl_console()), ("openrlhf.jsonl", openrlhf_jsonl())])
def test_every_format_reads_the_same_rows(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    rows = read_run(path)
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    for row, want in zip(rows, STEPS):
        assert {k: row[k] for k in want} == pytest.approx(want, rel=1e-12)


def test_summary_numbers(tmp_path):
    path = tmp_path / "trainer_state.json"
    path.write_text(trl_state())
    summary = summarise_run(read_run(path))
    assert summary["steps"] == 4 and summary["entropy_first"] == 1.0 and summary["entropy_last"] == pytest.approx(0.7)
    assert summary["clip_frac_mean"] == pytest.approx(0.02) and summary["clip_frac_median"] == pytest.approx(0.02)
    assert summary["steps_clipping_none"] == 1
    pred = [r["delta_entropy/predicted"] for r in STEPS]
    real = [r["delta_entropy/realised"] for r in STEPS]
    mp, mr = sum(pred) / 4, sum(real) / 4
    corr = sum((a - mp) * (b - mr) for a, b in zip(pred, real)) / math.sqrt(
        sum((a - mp) ** 2 for a in pred) * sum((b - mr) ** 2 for b in real))
    assert summary["dH_corr"] == pytest.approx(corr)


def test_plot_command_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "verl.jsonl"
    path.write_text(verl_file())
    assert main(["plot", str(path), "--out", str(tmp_path / "run.png")]) == 0
    out = capsys.readouterr().out
    assert "entropy (nats/token)        1.0000 -> 0.7000" in out and "clipped share" in out
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(path)]) == 0 and (tmp_path / "verl.png").is_file()  # default: beside the log


def test_a_log_without_metrics_is_refused_by_name(tmp_path, capsys):
    path = tmp_path / "other.log"
    path.write_text("step:1 - actor/pg_loss:0.1\nhello\n")
    assert main(["plot", str(path)]) == 2
    assert f"{path} holds no entropy_disc/* metric" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "absent.log")]) == 2
    assert main(["plot", str(path), "--out", str(tmp_path / "no" / "x.png")]) == 2


def test_suggest_mu_from_a_run_says_which_way(tmp_path, capsys):
    path = tmp_path / "trainer_state.json"
    path.write_text(trl_state())
    assert main(["suggest-mu", "--run", str(path), "--target-share", "0.02"]) == 0
    assert "keep mu" in capsys.readouterr().out
    assert main(["suggest-mu", "--run", str(path), "--target-share", "0.1"]) == 0
    assert "lower mu" in capsys.readouterr().out
    assert main(["suggest-mu", "--run", str(path), "--target-share", "0.005"]) == 0
    assert "raise mu" in capsys.readouterr().out
    monitor_only = tmp_path / "none.jsonl"
    monitor_only.write_text(json.dumps({"step": 1, "entropy_disc/entropy/mean": 1.0}))
    assert main(["suggest-mu", "--run", str(monitor_only)]) == 2
    assert "logs no entropy_disc/clip/frac" in capsys.readouterr().err
    assert main(["plot", str(monitor_only), "--out", str(tmp_path / "m.png")]) == 0
    assert "clipped share               not logged (no mask)" in capsys.readouterr().out
