"""What a person reads: tables and figures."""
