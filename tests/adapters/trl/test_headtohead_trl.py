"""The TRL path of the head-to-head: ``examples/trl/headtohead_trl.py`` with the real TRL.

* the wrapped model (``entropy_lab.hf_policy``) is TinyGPT: same logits on the same weights, the
  backbone's output is what the TRL adapter reads, the tokenizer's ids are the task's;
* ``--tiny`` runs end to end on CPU: both paths from one warm start (identical start evaluations), TRL's generation
  batches hold the own loop's prompts in its order, the adapter's entropy equals TRL's, Clip_B clips tokens at a small
  mu where GRPO clips none, and the comparison report is written.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from _trl_harness import ROOT

from entropy_lab.countdown import VOCAB_SIZE
from entropy_lab.headtohead import HeadConfig
from entropy_lab.hf_policy import (
    EOS_ID,
    PAD_ID,
    countdown_tokenizer,
    hf_from_tinygpt_state,
    prompt_text,
    tinygpt_state,
)
from entropy_discriminator.demo.model import TinyGPT


def _script():
    spec = importlib.util.spec_from_file_location("ed_headtohead_trl", ROOT / "examples" / "trl" / "headtohead_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wrapped_tinygpt_is_tinygpt():
    cfg = HeadConfig(targets="uniform")
    torch.manual_seed(3)
    tiny = TinyGPT(cfg.model_config())
    state = {k: v.clone() for k, v in tiny.state_dict().items()}
    hf = hf_from_tinygpt_state(state, cfg.model_config())
    task = cfg.task()
    x, t = task.sample(6, torch.Generator().manual_seed(0), split="train")
    prompts = task.prompts(x, t)
    seq = torch.cat([prompts, torch.randint(0, VOCAB_SIZE, (6, task.response_len))], 1)
    with torch.no_grad():
        assert torch.equal(hf(seq).logits, tiny(seq))
        hidden = hf.base_model(seq).last_hidden_state  # where the adapter's capture reads
        head = hf.get_output_embeddings()
        torch.testing.assert_close(hidden @ head.weight.T + head.bias, tiny(seq), rtol=0, atol=1e-5)
    assert hf.base_model is hf.model
    back = tinygpt_state(hf)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert torch.equal(hf.to_tinygpt()(seq), tiny(seq))
    tok = countdown_tokenizer()
    assert tok(prompt_text(prompts), add_special_tokens=False)["input_ids"] == prompts.tolist()
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD_ID, EOS_ID) and min(PAD_ID, EOS_ID) >= VOCAB_SIZE
    with pytest.raises(ValueError, match="padded"):
        hf(seq, attention_mask=torch.cat([torch.zeros(6, 1, dtype=torch.long), torch.ones(6, seq.shape[1] - 1, dtype=torch.long)], 1))


def test_tiny_mode_end_to_end(tmp_path):
    """The documented ``--tiny`` smoke with GRPO and Clip_B at mu = 1 (so that Clip_B clips in 3 tiny steps)."""
    h = _script()
    threads = torch.get_num_threads()
    assert h.main(["--tiny", "--arms", "grpo,clip_b", "--clip-b-mu", "1", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads
    runs = {(r["path"], r["family"]): r for r in map(json.loads, (tmp_path / "runs.jsonl").read_text().splitlines())}
    assert set(runs) == {(p, f) for p in ("own", "trl") for f in ("grpo", "clip_b")}
    for (path, family), r in runs.items():
        assert [c["step"] for c in r["checkpoints"]] == [0, 2, 3]
        assert [x["step"] for x in r["records"]] == [1, 2, 3]
        assert all(0.0 < x["entropy"] < math.log(VOCAB_SIZE) for x in r["records"])
        for c in r["checkpoints"]:
            for temp in ("T0.7", "T1.0"):
                assert 0.0 <= c[temp]["avg"] <= 1.0 and set(c[temp]["pass"]) == {"1", "4", "16", "64"}
        if path == "trl":
            assert r["prompts_as_own_loop"]  # TRL's generation batches: the own loop's prompts, in its order
            for x in r["records"]:  # the adapter's statistics (hidden states x head) = TRL's own entropy
                assert x["entropy_adapter"] == pytest.approx(x["entropy"], rel=1e-5)
    # one warm start, one evaluation stream: the start's evaluation is the same on both paths and arms
    starts = {json.dumps(r["checkpoints"][0], sort_keys=True) for r in runs.values()}
    assert len(starts) == 1
    # the arms differ where they should: Clip_B clips tokens, GRPO none (on both paths)
    for path in ("own", "trl"):
        assert all(x["control_frac"] == 0.0 for x in runs[(path, "grpo")]["records"])
        assert sum(x["control_frac"] for x in runs[(path, "clip_b")]["records"]) > 0.0
    text = (tmp_path / "comparison.md").read_text()
    assert "## Entropy curves" in text and "## Frontier points at T = 0.7" in text and "trl: clip_b(mu=1)" in text
    assert (tmp_path / "entropy_curves.csv").read_text().count("\n") == 4
    # a second call into the same folder resumes: nothing left to run
    h.run_all(*_tiny_args(h), tmp_path, log=lambda m: None)
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 4


def _tiny_args(h):
    cfg, spec = h.tiny_setup()
    return spec, {k: a for k, a in h.arms(1.0).items() if k in ("grpo", "clip_b")}, spec.checkpoints[-1]
