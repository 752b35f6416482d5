"""Our file formats and the foreign ones we read: one reader and one validator each."""
