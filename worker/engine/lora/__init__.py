"""LoRA adapters: PEFT reading (``adapter``), the host-memory tier (``registry``), the GPU slot
table (``slots``) and the slot stacks a forward pass reads (``weights``). docs/lora.md."""
