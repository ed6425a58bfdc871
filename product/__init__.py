"""What a product plugs into Flywheel: the contracts its code implements (an eval suite and its
verifier). Nothing here knows a product; the demo (`demo/`) is one implementation."""
