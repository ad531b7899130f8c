"""The typed report and what is made from it: summary rows, profile tables, the model card."""
