// spendgate: a client for spendgate's decision API. Reserve before each paid step, commit
// what it used after, and let a lost outcome be charged in full.
//
//   const sg = new Client({ baseUrl: "http://127.0.0.1:8080", serviceToken });
//   await using run = await sg.run({ session, clientIp, conversation, inputText });
//   await using step = await run.modelStep({ model: "gpt-4o-mini", promptTokens: 900 });
//   const answer = await callModel({ max_tokens: step.maxOutputTokens });
//   await step.commit(answer.usage);

import "./polyfill.js";

export * from "./client.js";
export * from "./errors.js";
export type * from "./types.js";
