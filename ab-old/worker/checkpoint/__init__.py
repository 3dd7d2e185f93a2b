"""The model's configuration (config.json) and its checkpoint loader (safetensors -> plain weights)."""
