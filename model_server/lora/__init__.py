"""LoRA adapters (vLLM's `--enable-lora`): PEFT folders served beside the base model, mixed in
one batch. `request` and `config` are plain values (the engine's bookkeeping and the settings
read them); `peft` reads an adapter folder, `layers` adds the adapters' products to the fused
linear layers, `manager` keeps adapters in host memory and in the device slots. Nothing here
runs at import time."""
