"""One module per notebook (its topic name), each with that notebook's figures and explorers;
`controls` holds what they share."""
