"""The research harness behind docs/reproduction/: experiments built on the ``entropy_discriminator`` library.

Installed from a clone of the repository with ``pip install -e ./lab`` (after the library).  Every experiment sizes
and warms up its policy with the library demo's :class:`~entropy_discriminator.demo.train.LoopConfig` and
:func:`~entropy_discriminator.demo.train.warm_up`; the Countdown experiments train with the one RL loop of
:mod:`entropy_lab.rl` (:func:`~entropy_lab.rl.rl_steps`), the paper reproduction with the demo's GRPO runs
(:func:`~entropy_discriminator.demo.train.run_arm`), and the law evaluation with its own instrumented optimizer step
(:func:`entropy_lab.law_eval.run`, which times each phase and also drives ``examples/custom_loop.py``'s model).

- :mod:`entropy_lab.rl`: the RL loop, its arms (:class:`~entropy_lab.rl.Arm`) and the warm start of a seed;
- :mod:`entropy_lab.compare`: ``entropy-discriminator compare``, Clip_B / Clip_V against peer entropy controls on
  signed-sum Countdown (:mod:`entropy_lab.countdown`), with its report (:mod:`entropy_lab.compare_report`);
- :mod:`entropy_lab.headtohead`, :mod:`entropy_lab.tuning`, :mod:`entropy_lab.stats_tests` and
  :mod:`entropy_lab.protocol` (``python -m entropy_lab.protocol``): the pre-registered head-to-head; its TRL path
  through :mod:`entropy_lab.hf_policy`;
- :mod:`entropy_lab.law_eval` (``python -m entropy_lab.law_eval``): the law's predictions against realised changes;
- :mod:`entropy_lab.paper` and :mod:`entropy_lab.paper_report`: ``entropy-discriminator demo --paper``;
- :mod:`entropy_lab.records`: record files, plain or compressed.
"""
