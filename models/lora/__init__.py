"""LoRA on the device, in one place: the slot pools' layout (``layout``), the host arrays written into a slot
(``pools``), DoRA scales and LoRA biases (``dora_bias``), embed_tokens and lm_head adapters (``embedding``);
a mixture of experts' expert and router adapters sit with their experts (``models.moe``)."""
