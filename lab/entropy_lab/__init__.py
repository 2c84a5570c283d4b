"""The research harness behind docs/reproduction/: experiments built on the ``entropy_discriminator`` library.

Installed from a clone of the repository with ``pip install -e ./lab`` (after the library).  Every experiment trains
with the demo's loop pieces (:mod:`entropy_discriminator.demo.train`) and the one RL loop of :mod:`entropy_lab.rl`:

- :mod:`entropy_lab.compare`: ``entropy-discriminator compare``, Clip_B / Clip_V against peer entropy controls on
  signed-sum Countdown (:mod:`entropy_lab.countdown`), with its report (:mod:`entropy_lab.compare_report`);
- :mod:`entropy_lab.headtohead`, :mod:`entropy_lab.tuning`, :mod:`entropy_lab.stats_tests` and
  :mod:`entropy_lab.protocol` (``python -m entropy_lab.protocol``): the pre-registered head-to-head; its TRL path
  through :mod:`entropy_lab.hf_policy`;
- :mod:`entropy_lab.law_eval` (``python -m entropy_lab.law_eval``): the law's predictions against realised changes;
- :mod:`entropy_lab.paper` and :mod:`entropy_lab.paper_report`: ``entropy-discriminator demo --paper``;
- :mod:`entropy_lab.records`: record files, plain or compressed.
"""
