"""The usage a client sees: P/D answers' usage rewritten, in each API's fields; hidden usage taken out."""
