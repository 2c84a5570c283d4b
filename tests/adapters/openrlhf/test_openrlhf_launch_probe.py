"""The GPU launch's probe and check (``tests/gpu/launch_openrlhf.py``, ``tests/gpu/openrlhf_site/sitecustomize.py``) on
the real patched ``ActorPPOTrainer.ppo_train``, on a CPU: what the probe records of a round is what the adapter
computed, the check's recomputation from those records reproduces the adapter's keep-mask and controller state, and
the check reads the ``entropy_disc/*`` metrics back from a status line as OpenRLHF's driver logs it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from test_openrlhf import EntropyDiscConfig, adapter, filled_buffer, real_trainer, rollout_batch, tiny_actor  # noqa: E402

from entropy_discriminator.adapters.openrlhf import _round  # noqa: E402

GPU = HERE.parents[1] / "gpu"
sys.path.insert(0, str(GPU))
import launch_openrlhf  # noqa: E402


def _load_site():
    spec = importlib.util.spec_from_file_location("ed_openrlhf_site", GPU / "openrlhf_site" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # ED_LAUNCH_PROBE_DIR is unset here: it installs no import hook
    return module


SITE = _load_site()
SETTINGS = {
    "clip_v": dict(method="clip_v", mu_low=1.0, mu_high=1.0, sides="both"),
    "autopilot": dict(method="autopilot", eta=2.0, sides="both", max_frac=0.25, mask_mode="drop_token",
                      calibrate_every=1),
}


@pytest.mark.parametrize("method", list(SETTINGS))
def test_probe_records_the_round_and_check_recomputes_it(method, tmp_path, monkeypatch):
    monkeypatch.setenv("ED_LAUNCH_PROBE_DIR", str(tmp_path))
    monkeypatch.setattr(_round, "begin_round", SITE._probe(_round.begin_round))  # before the patch binds it
    adapter.patch(EntropyDiscConfig(**SETTINGS[method]))
    actor = tiny_actor()
    statuses, kept = [], []
    original_apply = _round.apply_keep
    monkeypatch.setattr(_round, "apply_keep", lambda items, keep, mode: (kept.append(keep.clone()),
                                                                        original_apply(items, keep, mode))[1])
    for step in range(3):
        buffer = filled_buffer(rollout_batch(10 + step, n=8), micro_batch_size=2, monkeypatch=monkeypatch)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # ppo_train moves batches there
        statuses.append(real_trainer(actor, buffer, epochs=1).ppo_train(0.0))
    records = [torch.load(p, weights_only=False) for p in sorted(tmp_path.glob("round-*.pt"))]
    first = records[0]["round"]  # the probe counts the rounds of its process
    assert [r["round"] for r in records] == [first, first + 1, first + 2]
    clipped = 0
    for i, (rec, status, keep) in enumerate(zip(records, statuses, kept)):
        assert torch.equal(rec["keep"], keep)  # the mask the adapter wrote into the buffer
        assert rec["advantages"].shape == rec["stats"]["valid"].shape == keep.shape
        again, after = launch_openrlhf.recompute(rec)
        assert torch.equal(again, keep)
        clipped += int((~keep & rec["stats"]["valid"]).sum())
        if method == "autopilot":
            assert rec["after"]["step"] == i + 1 and launch_openrlhf.state_diff(after, rec["after"]) <= 1e-12
            assert (rec["before"] is None) == (i == 0)  # bound lazily here (no ActorPPOTrainer.__init__)
            if i:  # between rounds only the law calibration fed after the update (end_round) changes
                prev, now = launch_openrlhf._flat(records[i - 1]["after"]), launch_openrlhf._flat(rec["before"])
                changed = {k for k in prev.keys() | now.keys() if prev.get(k) != now.get(k)}
                assert changed and all(k.startswith("calibration.") for k in changed), changed
        else:
            assert rec["before"] is None and after is None
        line = f"(PPOTrainer pid=1) INFO ✨ Global step {i + 1}: {dict(status, policy_loss=0.5)}"
        logged = launch_openrlhf.logged_steps(line)[i + 1]
        ours = rec["metrics"]
        assert logged.keys() == {k for k in status if k.startswith("entropy_disc/")} >= ours.keys()
        assert all(logged[k] == v or (math.isnan(v) and math.isnan(logged[k])) for k, v in ours.items())
    assert clipped > 0
    assert launch_openrlhf.state_diff({"a": {"b": 1.0}}, {"a": {"b": 1.0 + 1e-9}}) == pytest.approx(1e-9, rel=1e-3)
    assert launch_openrlhf.state_diff({"a": 1.0}, {"b": 1.0}) == math.inf
