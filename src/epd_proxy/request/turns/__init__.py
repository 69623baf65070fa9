"""Multi-turn KV reuse: a conversation's next turn reads what decode kept of the last."""
