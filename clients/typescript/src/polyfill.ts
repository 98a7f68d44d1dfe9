// `Symbol.asyncDispose` for runtimes that lack it (Node 20 defines it; some edge runtimes and
// older browsers do not). TypeScript's `await using` looks it up when the block is entered, and
// the classes of this package name their dispose method by it, so it must exist before they
// are defined. Defined as the registered symbol other polyfills (core-js, TypeScript's docs)
// use, so they agree.
const sym = Symbol as unknown as { asyncDispose?: symbol; dispose?: symbol };
if (typeof sym.asyncDispose !== "symbol") {
  Object.defineProperty(Symbol, "asyncDispose", { value: Symbol.for("Symbol.asyncDispose") });
}
if (typeof sym.dispose !== "symbol") {
  Object.defineProperty(Symbol, "dispose", { value: Symbol.for("Symbol.dispose") });
}
export {};
