"""The model core: config, layers, attention, MoE, caches, checkpoint I/O and the utilities they use.

It imports only `backends` (the public interface): `glm5.parallel` and `quant` sit above it, the
applications (train, deploy, port, generate, export, the vLLM plugin, the CLI) above those (README "Layers").
"""
