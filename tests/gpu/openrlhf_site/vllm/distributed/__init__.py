"""TEST STAND-IN (see ``vllm/__init__.py``): the two names OpenRLHF's ``stateless_init_process_group`` imports for its
weight sync without CUDA IPC (``--vllm.sync_backend`` other than ``nccl``; ``launch_openrlhf.py --weight-sync gloo``)."""
