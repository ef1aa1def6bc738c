"""The training stage: options (:mod:`.config`), the training loop (:mod:`.loop`), its losses
(:mod:`.loss`), held-out evaluation (:mod:`.evaluation`), checkpoints and resumption
(:mod:`.checkpointer`), the ``cond(T)`` floor and ``delta_ti`` stop (:mod:`.interface_guard`),
LoRA (:mod:`.lora`), sharding for DDP/FSDP (:mod:`.sharding`) and the paper's from-scratch
architectures (:mod:`.architectures`). The data it reads is :mod:`pit_deploy.data`. See
``docs/training.md``.
"""
