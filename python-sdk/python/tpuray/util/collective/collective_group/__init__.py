"""The group classes behind ``tpuray.util.collective`` (one per backend)."""
