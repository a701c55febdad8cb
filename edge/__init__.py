"""Edge devices: QAT/INT8 export, signed artifacts, model sync (filled by later work)."""
