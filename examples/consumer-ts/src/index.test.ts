// The program itself (src/index.ts) under the mock engine, against the platform's dev outputs.
import { strict as assert } from "node:assert";
import { test } from "node:test";
import * as pulumi from "@pulumi/pulumi";
import { mockStacks, platformOutputs, schemaFile } from "./mocks";

test("the program exports the model's URL read through the StackReference", async () => {
  const dev: any = platformOutputs();
  mockStacks({ "acme/gpu-inference-platform/dev": dev });
  pulumi.runtime.setAllConfig({
    "gpuinfra-consumer-ts:platform_stack": "acme/gpu-inference-platform/dev",
    "gpuinfra-consumer-ts:model": "qwen3-8b",
    "gpuinfra-consumer-ts:cluster": "dev-use1",
    "gpuinfra-consumer-ts:contract_schema": schemaFile(),
  });
  const program = await import("./index");
  const e = dev.models["qwen3-8b"].endpoints["dev-use1"];
  assert.equal(await program.openaiBaseUrl, `${e.router_url ?? e.service_url}/v1`);
  assert.equal(await program.servedModelName, "qwen3-8b");
  assert.equal(await program.contractVersion, dev.contract_version);
  assert.equal(await (program.platformKubeconfig as any).isSecret, true);
});
