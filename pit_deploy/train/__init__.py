"""The training stage: data streams (:mod:`.data`), the training loop (:mod:`.loop`), LoRA
(:mod:`.lora`), sharding for DDP/FSDP (:mod:`.sharding`) and the paper's from-scratch
architectures (:mod:`.architectures`). See ``docs/training.md``.
"""
