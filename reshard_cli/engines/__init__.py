"""Integrations with inference engines, each in a room of its own (`vllm/`): everything that touches an
engine's internals lives there, above the transfer layer it drives. What every engine shares (the handshake, a
fleet's replicas and members) is `fleet/`, which imports no engine."""
