"""GLM-5 on the backend layer: model, generation and training (they call `backends` ops only)."""
