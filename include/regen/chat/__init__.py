"""Chat templates, rendering and the loss mask, as SpecForge's training sees a conversation."""
