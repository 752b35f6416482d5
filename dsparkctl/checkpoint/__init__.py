"""Checkpoint surgery: safe safetensors reading, draft layouts, inspect, extract, dequantize, hub."""
