// Test support: Pulumi's mock engine, with each StackReference answered from a JSON document of
// stack outputs (what the Pulumi service would return), keyed by the referenced stack's name.
import { readFileSync } from "node:fs";
import * as pulumi from "@pulumi/pulumi";

export type Outputs = Record<string, unknown>;

/** The platform's real outputs, written by tests/test_contract_consumer_ts.py from a mock run. */
export function platformOutputs(): Outputs {
  const file = process.env.PLATFORM_OUTPUTS;
  if (!file) {
    throw new Error("PLATFORM_OUTPUTS: path of a JSON file with the platform stack's outputs");
  }
  return JSON.parse(readFileSync(file, "utf8"));
}

export function schemaFile(): string {
  const file = process.env.CONTRACT_SCHEMA;
  if (!file) {
    throw new Error("CONTRACT_SCHEMA: path of gpuinfra_contract/schema/contract-<version>.json");
  }
  return file;
}

export function mockStacks(stacks: Record<string, Outputs>): void {
  pulumi.runtime.setMocks(
    {
      newResource: (args: pulumi.runtime.MockResourceArgs) => {
        if (args.type !== "pulumi:pulumi:StackReference") {
          return { id: `${args.name}-id`, state: args.inputs };
        }
        const outputs = stacks[args.inputs.name];
        if (outputs === undefined) {
          throw new Error(`no mocked stack '${args.inputs.name}'`);
        }
        return { id: args.inputs.name, state: { ...args.inputs, outputs, secretOutputNames: ["kubeconfigs"] } };
      },
      call: (args: pulumi.runtime.MockCallArgs) => args.inputs,
    },
    "gpuinfra-consumer-ts",
    "dev",
    false,
  );
}
