//! Fuzzes the text parser: no input panics it, and every graph it accepts prints to text that parses
//! back to the same graph.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(graph) = ir_graph::parse(text) else { return };
    let printed = graph.to_string();
    let again = ir_graph::parse(&printed).expect("printed graphs parse");
    assert!(again.structurally_eq(&graph), "print/parse round trip:\n{printed}");
});
