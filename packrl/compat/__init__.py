"""Other systems' configurations read as packrl's: ``compat.verl`` turns a verl launch script's
overrides into a packrl preset plus overrides (`packrl verl`). Nothing at run time imports it;
it sits above ``config``, whose loader and schema it uses."""
