"""Two CPU processes (accelerate over gloo) give the statistics of one process on the whole batch.

Each spawned process builds a real ``EntropyDiscGRPOTrainer`` (accelerate initialises the gloo
process group from RANK/WORLD_SIZE) with the same tiny model, takes its half of one fixed
generation batch, scores it through TRL's own log-prob method with the hidden states captured
(the adapter's extra-pass route) and masks it over the generation batch (Clip_B zero_pg, Clip_V
drop_token, one autopilot step drop_token) and per micro-batch (the training-forward / current routes).  The keep-masks,
``num_items_in_batch`` and every ``entropy_disc/`` metric must equal those of a single process on
the whole batch.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import socket

import pytest
import torch
import torch.multiprocessing as mp

if os.environ.get("ED_REQUIRE_TRL"):
    import trl  # noqa: F401
else:
    pytest.importorskip("trl", reason="TRL is installed only in the nox 'trl' session")

ROOT = pathlib.Path(__file__).resolve().parents[3]
WORLD = 2
ROWS = 8  # generation batch rows; each of the 2 ranks holds 4


def _tiny():
    spec = importlib.util.spec_from_file_location("ed_trl_tiny", ROOT / "examples" / "trl" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """A fixed generation batch: ragged completions, advantages of both signs, a tool mask."""
    g = torch.Generator().manual_seed(1)
    p, t = 3, 7
    lengths = torch.tensor([7, 3, 5, 7, 1, 6, 4, 7])
    cmask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    tool = torch.ones(ROWS, t, dtype=torch.long)
    tool[3, 2:4] = 0
    return {
        "prompt_ids": torch.randint(4, vocab, (ROWS, p), generator=g),
        "prompt_mask": torch.ones(ROWS, p, dtype=torch.long),
        "completion_ids": torch.randint(4, vocab, (ROWS, t), generator=g),
        "completion_mask": cmask,
        "tool_mask": tool,
        "advantages": torch.tensor([1.2, -0.7, 0.0, -1.5, 0.4, -0.2, 2.0, -0.9]),
        "num_items_in_batch": (cmask * tool).sum(),
    }


def _run(trainer, rows: slice) -> dict[str, object]:
    """The adapter's statistics and masks on ``rows`` of the fixed batch; returns masks, counts, metrics."""
    from entropy_discriminator import EntropyDiscConfig
    from entropy_discriminator.adapters.trl import _autopilot, _mask, _patch, _stats, _support

    trainer.model.train()
    full = _batch(trainer.model.config.vocab_size)
    half = {k: (v[rows] if v.dim() else v) for k, v in full.items()}
    results: dict[str, object] = {}
    for name, cfg, route in (
        ("clip_b", EntropyDiscConfig(method="clip_b", mu_low=0.8, mu_high=1.0, sides="both"), _support.EXTRA_PASS),
        ("clip_v", EntropyDiscConfig(method="clip_v", mu_low=0.5, mu_high=0.5, sides="negative", max_frac=0.2,
                                     mask_mode="drop_token"), _support.EXTRA_PASS),
        ("current", EntropyDiscConfig(method="clip_v", mu_low=0.5, mu_high=0.5, sides="both", max_frac=0.3),
         _support.CURRENT),
        ("autopilot", EntropyDiscConfig(method="autopilot", target_entropy=3.15, eta=2.0, sides="both", max_frac=0.25,
                                        mask_mode="drop_token"), _support.EXTRA_PASS),
    ):
        trainer._metrics["train"].clear()
        state = _patch.AdapterState(cfg, "current" if route == _support.CURRENT else "generation")
        state.plan = _support.Plan(route)
        if cfg.method == "autopilot":
            _autopilot.sync(trainer, state)  # what the first training generation does
        trainer.__dict__[_patch._STATE_ATTR] = state  # the trainer's wrappers read this state
        _patch._extra_pass(trainer, state, half)
        stats = _stats.restrict(state.captured, _mask.loss_mask(half))
        if route == _support.CURRENT:
            parked = dict(half)
            _patch._mask_micro_batch(trainer, state, parked, stats)
            results[name] = {"advantages": parked["advantages"]}
        else:
            out = _patch._mask_generation_batch(trainer, state, dict(half), stats)
            results[name] = {"keep": out[_mask.KEEP_KEY], "num_items": int(out["num_items_in_batch"])}
        if cfg.method == "autopilot":
            results[name]["state"] = state.autopilot.state_dict()
        results[name]["metrics"] = {k: v[0] for k, v in trainer._metrics["train"].items()}
    return results


def _make_trainer(tmp: str):
    from entropy_discriminator.adapters.trl import EntropyDiscGRPOConfig, EntropyDiscGRPOTrainer

    tiny = _tiny()
    tok = tiny.tiny_tokenizer()
    args = EntropyDiscGRPOConfig(output_dir=tmp, per_device_train_batch_size=4, num_generations=4,
                                 max_completion_length=7, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                                 disable_dropout=True)
    return EntropyDiscGRPOTrainer(model=tiny.tiny_model(tok), reward_funcs=tiny.digit_reward, args=args,
                                  train_dataset=tiny.tiny_dataset(), processing_class=tok)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    trainer = _make_trainer(os.path.join(out_dir, f"out{rank}"))
    assert trainer.accelerator.num_processes == WORLD and torch.distributed.get_backend() == "gloo"
    per = ROWS // WORLD
    torch.save(_run(trainer, slice(rank * per, (rank + 1) * per)), os.path.join(out_dir, f"rank{rank}.pt"))
    # Leave together and tear the gloo group down before the interpreter exits: a process that exits
    # with a live group can abort in gloo's threads ("terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flat(state: dict, prefix: str = "") -> dict:
    """A nested controller state as one flat mapping (``pytest.approx`` compares flat ones only)."""
    out: dict = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.distributed
def test_two_gloo_processes_match_one_process_on_the_whole_batch(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    whole = _run(_make_trainer(str(tmp_path / "single")), slice(0, ROWS))

    for name in ("clip_b", "clip_v", "autopilot"):
        keep = torch.cat([r[name]["keep"] for r in ranks])
        assert torch.equal(keep, whole[name]["keep"]), name
        assert 0 < (~whole[name]["keep"]).sum() < whole[name]["keep"].numel()
        assert all(r[name]["num_items"] == whole[name]["num_items"] for r in ranks)
    # drop_token: the normaliser is the global kept-token count.
    assert whole["clip_v"]["num_items"] == int((_batch(100)["completion_mask"] * _batch(100)["tool_mask"]).bool()
                                               .logical_and(whole["clip_v"]["keep"]).sum())
    torch.testing.assert_close(torch.cat([r["current"]["advantages"] for r in ranks]), whole["current"]["advantages"])
    # The autopilot: the same selection and one controller state (step 1, H_0 = the global entropy) on every rank.
    assert whole["autopilot"]["state"]["step"] == 1
    expected_state = _flat(whole["autopilot"]["state"])
    for r in ranks:
        state = _flat(r["autopilot"]["state"])
        assert state.keys() == expected_state.keys()
        for key, value in expected_state.items():
            if isinstance(value, float):
                assert state[key] == pytest.approx(value, rel=1e-12), key
            else:
                assert state[key] == value, key
    assert "entropy_disc/autopilot/target_dh" in whole["autopilot"]["metrics"]
    for name in ("clip_b", "clip_v", "current", "autopilot"):
        expected = whole[name]["metrics"]
        assert "entropy_disc/clip/frac" in expected and "entropy_disc/entropy/p50" in expected
        for r in ranks:
            assert r[name]["metrics"].keys() == expected.keys()
            for key, value in expected.items():
                assert r[name]["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-12), (name, key)
