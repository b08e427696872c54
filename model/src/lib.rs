//! A model of redlease's lease protocol, checked with stateright.
