"""The vLLM engine deployment and default-model provisioning."""
