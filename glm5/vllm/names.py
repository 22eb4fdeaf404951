"""The plugin's architecture names (a leaf module: the plugin's modules import it, it imports nothing)."""

ARCHITECTURE = "Glm5BackendsForCausalLM"
HF_OVERRIDES = {"architectures": [ARCHITECTURE]}
MTP_ARCHITECTURE = "Glm5BackendsMTP"
