"""The demo of the whole product on a local cluster, and the steps it shares with the end-to-end
suite (`lora_demo.manifests`, `lora_demo.release`). `python -m lora_demo` runs the demo."""
