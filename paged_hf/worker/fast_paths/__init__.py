"""CPU fast paths swapped in for a step: oneDNN-packed linears, fused Llama-code layers, lean decode layers, the
decoder stack in one compiled call."""
